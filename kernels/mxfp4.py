"""MXFP4 (OCP microscaling: FP4 E2M1 codes, one E8M0 scale per 32 values) as gpt-oss stores experts.

Owns the format: packing and unpacking, the layout and payload byte count of one expert, and the
grouped SwiGLU over MXFP4 experts (torch reference; the Triton path decodes blocks in registers
inside the GEMMs of `pdflash.kernels.triton_swiglu`, imported lazily so the format itself needs no triton).

A [..., K] tensor is stored as blocks [..., K/32, 16] uint8 holding two codes a byte (low nibble =
even element, high nibble = odd element) and scales [..., K/32] uint8 meaning 2^(byte - 127).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pdflash.kernels.grouped_swiglu import check_swiglu_args, grouped_swiglu_reference
from pdflash.kernels.routing import Routing

BLOCK_SIZE = 32  # values sharing one scale byte
FP4_MAX = 6.0
FP4_VALUES = (0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6)  # by 4-bit code
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between consecutive FP4 magnitudes

TensorSpec = tuple[Sequence[int], torch.dtype]  # (shape, dtype) of a tensor not at hand
# [256, 2]: the (even, odd) values a byte holds. One lookup a byte instead of two a nibble unpacks
# a gpt-oss-20b gate_up matrix (5760 x 2880) in 91 ms against 320 ms (1 thread, the 2-core CPU).
_BYTE_VALUES = torch.tensor([[FP4_VALUES[b & 0xF], FP4_VALUES[b >> 4]] for b in range(256)], dtype=torch.float32)


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks [..., K/32, 16] uint8, scales [..., K/32] uint8) of w [..., K].

    Each block's scale is the smallest power of two that brings its max |value| within 6 (2^127
    at most, where larger values saturate); values round to the nearest code, ties to even.
    """
    if w.dim() == 0 or w.shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(f"w must be [..., K] with K a multiple of 32; got shape {tuple(w.shape)}")
    groups = w.float().reshape(*w.shape[:-1], -1, BLOCK_SIZE)  # [..., B, 32]
    amax = groups.abs().amax(dim=-1)  # [..., B]
    exponent = torch.ceil(torch.log2(amax / FP4_MAX))  # [..., B], -inf for all-zero blocks
    exponent += amax > FP4_MAX * torch.exp2(exponent)  # log2 may round one below
    exponent = exponent.clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]  # [..., B, 32] |values| <= 6 unless saturated
    magnitude = scaled.abs()
    midpoints = torch.tensor(_MIDPOINTS, device=w.device)
    code = torch.bucketize(magnitude, midpoints)  # [..., B, 32] 0..7, a midpoint goes down
    code += (code % 2 == 1) & (magnitude == midpoints[code.clamp(max=6)])  # ...unless that is odd
    code |= ((scaled < 0) & (code > 0)).long() << 3  # sign bit; zero stays +0
    blocks = (code[..., 0::2] | code[..., 1::2] << 4).to(torch.uint8)  # [..., B, 16]
    return blocks, (exponent + 127).to(torch.uint8)


def unpack_mxfp4(
    blocks: torch.Tensor,  # [..., B, 16] uint8
    scales: torch.Tensor,  # [..., B] uint8
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The [..., B*32] tensor of `dtype` that the blocks and scales encode."""
    if blocks.dtype != torch.uint8 or blocks.dim() < 2 or blocks.shape[-1] != 16:
        raise ValueError(f"blocks must be uint8 [..., B, 16]; got {blocks.dtype} {tuple(blocks.shape)}")
    if scales.dtype != torch.uint8 or scales.shape != blocks.shape[:-1]:
        raise ValueError(f"scales must be uint8 {tuple(blocks.shape[:-1])}; got {scales.dtype} {tuple(scales.shape)}")
    pairs = F.embedding(blocks.int(), _BYTE_VALUES.to(blocks.device))  # [..., B, 16, 2]: one lookup a byte
    values = pairs.reshape(*blocks.shape[:-1], BLOCK_SIZE)  # [..., B, 32]
    values.mul_(torch.exp2(scales.float() - 127).unsqueeze(-1))
    return values.flatten(-2).to(dtype)  # [..., B*32]


def mxfp4_expert_layout(
    hidden_size: int, intermediate_size: int, bias_dtype: torch.dtype | None = torch.bfloat16
) -> dict[str, TensorSpec]:
    """Shape and dtype of each tensor of one MXFP4 expert; bias_dtype None = no biases."""
    for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        if size <= 0 or size % BLOCK_SIZE != 0:
            raise ValueError(f"{name} must be a positive multiple of 32; got {size}")
    h_blocks, i_blocks = hidden_size // BLOCK_SIZE, intermediate_size // BLOCK_SIZE
    layout: dict[str, tuple[Sequence[int], torch.dtype]] = {
        "gate_blocks": ((intermediate_size, h_blocks, 16), torch.uint8),
        "gate_scales": ((intermediate_size, h_blocks), torch.uint8),
        "up_blocks": ((intermediate_size, h_blocks, 16), torch.uint8),
        "up_scales": ((intermediate_size, h_blocks), torch.uint8),
        "down_blocks": ((hidden_size, i_blocks, 16), torch.uint8),
        "down_scales": ((hidden_size, i_blocks), torch.uint8),
    }
    if bias_dtype is not None:
        layout |= {
            "gate_bias": ((intermediate_size,), bias_dtype),
            "up_bias": ((intermediate_size,), bias_dtype),
            "down_bias": ((hidden_size,), bias_dtype),
        }
    return layout


def payload_nbytes(*tensors: torch.Tensor | TensorSpec) -> int:
    """Σ numel × element size over tensors, each given as a tensor or a (shape, dtype) pair."""
    total = 0
    for tensor in tensors:
        shape, dtype = (tensor.shape, tensor.dtype) if isinstance(tensor, torch.Tensor) else tensor
        total += math.prod(shape) * dtype.itemsize
    return total


def mxfp4_expert_nbytes(
    hidden_size: int, intermediate_size: int, bias_dtype: torch.dtype | None = torch.bfloat16
) -> int:
    """Exact payload bytes of one MXFP4 expert: blocks, scales, biases (none if bias_dtype None)."""
    return payload_nbytes(*mxfp4_expert_layout(hidden_size, intermediate_size, bias_dtype).values())


def check_mxfp4_weights(
    x: torch.Tensor,
    gate_blocks: torch.Tensor,
    gate_scales: torch.Tensor,
    up_blocks: torch.Tensor,
    up_scales: torch.Tensor,
    down_blocks: torch.Tensor,
    down_scales: torch.Tensor,
) -> tuple[int, int]:
    """(S, I) after checking the six tensors against the layout for x's hidden size H."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H]; got shape {tuple(x.shape)}")
    if gate_blocks.dim() != 4:
        raise ValueError(f"gate_blocks must be [S, I, H/32, 16]; got {tuple(gate_blocks.shape)}")
    num_slots, inter = gate_blocks.shape[:2]
    layout = mxfp4_expert_layout(x.shape[1], inter, bias_dtype=None)
    given = {
        "gate_blocks": gate_blocks,
        "gate_scales": gate_scales,
        "up_blocks": up_blocks,
        "up_scales": up_scales,
        "down_blocks": down_blocks,
        "down_scales": down_scales,
    }
    for name, tensor in given.items():
        shape, dtype = layout[name]
        if tuple(tensor.shape) != (num_slots, *shape) or tensor.dtype != dtype:
            raise ValueError(
                f"{name} must be {dtype} {(num_slots, *shape)} for H={x.shape[1]}, I={inter}; "
                f"got {tensor.dtype} {tuple(tensor.shape)}"
            )
    return num_slots, inter


def mxfp4_grouped_swiglu_reference(
    x: torch.Tensor,  # [T, H]
    routing: Routing,
    gate_blocks: torch.Tensor,  # [S, I, H/32, 16] uint8
    gate_scales: torch.Tensor,  # [S, I, H/32] uint8
    up_blocks: torch.Tensor,  # [S, I, H/32, 16] uint8
    up_scales: torch.Tensor,  # [S, I, H/32] uint8
    down_blocks: torch.Tensor,  # [S, H, I/32, 16] uint8
    down_scales: torch.Tensor,  # [S, H, I/32] uint8
    slot_of_expert: torch.Tensor,  # [E] int64, -1 = skip
    out: torch.Tensor,  # [T, H] float32, added to in place
    gate_bias: torch.Tensor | None = None,  # [S, I] in x's dtype
    up_bias: torch.Tensor | None = None,  # [S, I]
    down_bias: torch.Tensor | None = None,  # [S, H]
) -> None:
    """Dequantize every slot to x's dtype, then `grouped_swiglu_reference` with the biases."""
    check_mxfp4_weights(x, gate_blocks, gate_scales, up_blocks, up_scales, down_blocks, down_scales)
    grouped_swiglu_reference(
        x,
        routing,
        unpack_mxfp4(gate_blocks, gate_scales, x.dtype),  # [S, I, H]
        unpack_mxfp4(up_blocks, up_scales, x.dtype),  # [S, I, H]
        unpack_mxfp4(down_blocks, down_scales, x.dtype),  # [S, H, I]
        slot_of_expert,
        out,
        gate_bias=gate_bias,
        up_bias=up_bias,
        down_bias=down_bias,
    )


def mxfp4_grouped_swiglu_triton(
    x: torch.Tensor,
    routing: Routing,
    gate_blocks: torch.Tensor,
    gate_scales: torch.Tensor,
    up_blocks: torch.Tensor,
    up_scales: torch.Tensor,
    down_blocks: torch.Tensor,
    down_scales: torch.Tensor,
    slot_of_expert: torch.Tensor,
    out: torch.Tensor,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> None:
    """Same contract as `mxfp4_grouped_swiglu_reference`; decodes the blocks inside the GEMMs."""
    from pdflash.kernels.triton_swiglu import launch_grouped_swiglu  # lazy: needs triton

    num_slots, inter = check_mxfp4_weights(x, gate_blocks, gate_scales, up_blocks, up_scales, down_blocks, down_scales)
    biases = (gate_bias, up_bias, down_bias)
    check_swiglu_args(
        x,
        routing,
        slot_of_expert,
        out,
        num_slots=num_slots,
        intermediate_size=inter,
        biases=dict(zip(("gate_bias", "up_bias", "down_bias"), biases)),
    )
    launch_grouped_swiglu(
        x,
        routing,
        slot_of_expert,
        out,
        (gate_blocks, up_blocks, down_blocks),
        (gate_scales, up_scales, down_scales),
        biases,
        inter,
    )
