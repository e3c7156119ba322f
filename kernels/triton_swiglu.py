"""Grouped expert SwiGLU in Triton: every routed expert in one launch per matmul stage.

Choice: a two-kernel split. `_gate_up_kernel`, one program per (token tile, block of I), computes
act = silu(x gateᵀ + b) * (x upᵀ + b) and writes it to act [T*K, I] in the permuted (grouped by
expert) order; `_down_kernel`, one program per (token tile, block of H), computes act downᵀ + b,
scales it by the routing weight and adds it into out[t] with atomic adds (a token's K
assignments land in different tiles). Each weight element is read once per token tile and no
matmul is recomputed; the intermediate holds T*K*I elements, small beside the expert weights.

A token tile is up to BLOCK_M consecutive assignments of one expert in `sorted_assignments`. The
tile table is built on the device with torch ops (no host sync), sized by an upper bound; spare
programs return at once. Experts whose slot is -1 or that have no tokens get no tiles.

With `clamp` the first stage computes gpt-oss's clamped SwiGLU over interleaved gate/up rows
instead (`pdflash.kernels.clamped_swiglu`). Weights are dense [S, R, C] in x's dtype, or MXFP4 (see `pdflash.kernels.mxfp4`): blocks [S, R, C/32, 16]
and scales [S, R, C/32], decoded tile by tile in registers, never written out whole.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pdflash.kernels.grouped_swiglu import check_dense_swiglu
from pdflash.kernels.routing import Routing


@triton.jit
def _weight_tile(w_ptr, scale_ptr, slot, rows, cols, num_rows, num_cols, MXFP4: tl.constexpr):
    """[BLOCK_K, BLOCK_N] tile W[slot, rows, cols]ᵀ of a [S, R, C] weight (float32 if MXFP4)."""
    mask = (cols[:, None] < num_cols) & (rows[None, :] < num_rows)
    row_base = slot * num_rows + rows[None, :]  # [1, BLOCK_N] row index into [S*R, ...]
    if MXFP4:
        packed = tl.load(
            w_ptr + row_base * (num_cols // 2) + cols[:, None] // 2, mask=mask, other=0
        )  # [BLOCK_K, BLOCK_N] uint8, each byte loaded for both of its elements
        nibble = (packed.to(tl.uint32) >> ((cols[:, None] % 2) * 4).to(tl.uint32)) & 0xF
        exponent = (nibble >> 1) & 3
        mantissa = nibble & 1
        # E2M1 -> float32 bits: exponent 0 is the subnormal 0 / 0.5, else 2^(e-1) * (1 + m/2)
        magnitude = tl.where(exponent == 0, mantissa * 0x3F000000, ((exponent + 126) << 23) | (mantissa << 22))
        value = (magnitude | ((nibble >> 3) << 31)).to(tl.float32, bitcast=True)
        scale = tl.load(scale_ptr + row_base * (num_cols // 32) + cols[:, None] // 32, mask=mask, other=127).to(
            tl.uint32
        )
        # E8M0 -> float32 bits 2^(byte-127); byte 0 is the float32 subnormal 2^-127
        scale = tl.where(scale == 0, 0x400000, scale << 23).to(tl.float32, bitcast=True)
        return value * scale
    return tl.load(w_ptr + row_base * num_cols + cols[:, None], mask=mask, other=0.0)


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    b = b.to(a.dtype)
    if UPCAST:  # the CPU interpreter multiplies bfloat16 operands as raw integers
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _add_bias(acc, bias_ptr, slot, feats, size, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        bias = tl.load(bias_ptr + slot * size + feats, mask=feats < size, other=0.0)  # [BLOCK_N]
        acc += bias.to(tl.float32)[None, :]
    return acc


@triton.jit
def _tile_rows(expert, tile_start_ptr, offsets_ptr, slot_ptr, BLOCK_M: tl.constexpr):
    """(slot, rows, row_mask) of this program's token tile; rows index the sorted order."""
    rows = tl.load(tile_start_ptr + tl.program_id(0)) + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    return tl.load(slot_ptr + expert), rows, rows < tl.load(offsets_ptr + expert + 1)


@triton.jit
def _gate_up_kernel(
    x_ptr,
    sorted_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    offsets_ptr,
    slot_ptr,
    gate_ptr,
    gate_scale_ptr,
    gate_bias_ptr,
    up_ptr,
    up_scale_ptr,
    up_bias_ptr,
    act_ptr,
    num_experts,
    hidden,
    inter,
    limit,
    alpha,
    TOP_K: tl.constexpr,
    MXFP4: tl.constexpr,
    CLAMPED: tl.constexpr,
    HAS_GATE_BIAS: tl.constexpr,
    HAS_UP_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    expert = tl.load(tile_expert_ptr + tl.program_id(0))
    if expert >= num_experts:  # spare tile
        return
    slot, rows, row_mask = _tile_rows(expert, tile_start_ptr, offsets_ptr, slot_ptr, BLOCK_M)
    tokens = tl.load(sorted_ptr + rows, mask=row_mask, other=0) // TOP_K  # [BLOCK_M]
    feats = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of I
    if CLAMPED:  # gpt-oss: one [S, 2I, ...] gate_up tensor whose rows alternate gate, up
        gate_rows, up_rows, num_rows = feats * 2, feats * 2 + 1, inter * 2
    else:
        gate_rows, up_rows, num_rows = feats, feats, inter
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        h = tl.load(
            x_ptr + tokens[:, None] * hidden + ks[None, :],
            mask=row_mask[:, None] & (ks[None, :] < hidden),
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        gate = _weight_tile(gate_ptr, gate_scale_ptr, slot, gate_rows, ks, num_rows, hidden, MXFP4)
        up = _weight_tile(up_ptr, up_scale_ptr, slot, up_rows, ks, num_rows, hidden, MXFP4)
        acc_gate = _dot(h, gate, acc_gate, PRECISION, UPCAST)
        acc_up = _dot(h, up, acc_up, PRECISION, UPCAST)
    acc_gate = _add_bias(acc_gate, gate_bias_ptr, slot, gate_rows, num_rows, HAS_GATE_BIAS)
    acc_up = _add_bias(acc_up, up_bias_ptr, slot, up_rows, num_rows, HAS_UP_BIAS)
    if CLAMPED:  # (min(up, ±limit) + 1) * glu(min(gate, limit)), glu(g) = g * sigmoid(alpha * g)
        acc_gate = tl.minimum(acc_gate, limit)
        acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        act = (acc_up + 1) * acc_gate * tl.sigmoid(acc_gate * alpha)  # [BLOCK_M, BLOCK_N]
    else:
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up  # [BLOCK_M, BLOCK_N]
    tl.store(
        act_ptr + rows[:, None] * inter + feats[None, :],
        act.to(act_ptr.dtype.element_ty),
        mask=row_mask[:, None] & (feats[None, :] < inter),
    )


@triton.jit
def _down_kernel(
    act_ptr,
    sorted_ptr,
    weights_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    offsets_ptr,
    slot_ptr,
    down_ptr,
    down_scale_ptr,
    down_bias_ptr,
    out_ptr,
    num_experts,
    hidden,
    inter,
    TOP_K: tl.constexpr,
    MXFP4: tl.constexpr,
    HAS_DOWN_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    expert = tl.load(tile_expert_ptr + tl.program_id(0))
    if expert >= num_experts:  # spare tile
        return
    slot, rows, row_mask = _tile_rows(expert, tile_start_ptr, offsets_ptr, slot_ptr, BLOCK_M)
    assignments = tl.load(sorted_ptr + rows, mask=row_mask, other=0)  # [BLOCK_M] t*K+k
    routing_weight = tl.load(weights_ptr + assignments, mask=row_mask, other=0.0)  # [BLOCK_M]
    feats = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of H
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        act = tl.load(
            act_ptr + rows[:, None] * inter + ks[None, :],
            mask=row_mask[:, None] & (ks[None, :] < inter),
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        down = _weight_tile(down_ptr, down_scale_ptr, slot, feats, ks, hidden, inter, MXFP4)
        acc = _dot(act, down, acc, PRECISION, UPCAST)
    acc = _add_bias(acc, down_bias_ptr, slot, feats, hidden, HAS_DOWN_BIAS)
    tl.atomic_add(
        out_ptr + (assignments // TOP_K)[:, None] * hidden + feats[None, :],
        acc * routing_weight[:, None],
        mask=row_mask[:, None] & (feats[None, :] < hidden),
    )


def _block(size: int) -> int:
    """Feature / reduction tile: 64, or the next power of two (at least 16) for small sizes."""
    return min(64, max(16, triton.next_power_of_2(size)))


def _tile_table(routing: Routing, slot_of_expert: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_expert, tile_start) per token tile; tile_expert == E marks a spare tile."""
    offsets = routing.expert_offsets  # [E+1]
    num_experts = routing.num_experts
    num_assignments = routing.sorted_assignments.numel()
    counts = offsets[1:] - offsets[:-1]  # [E]
    tiles = torch.where(slot_of_expert >= 0, (counts + block_m - 1) // block_m, 0)  # [E]
    tile_end = torch.cumsum(tiles, dim=0)  # [E]
    # Σ ceil(n_e / BLOCK_M) ≤ ceil(T*K / BLOCK_M) + (number of routed experts)
    bound = triton.cdiv(num_assignments, block_m) + min(num_experts, num_assignments)
    tile_ids = torch.arange(bound, device=offsets.device)  # [bound]
    tile_expert = torch.searchsorted(tile_end, tile_ids, right=True)  # [bound]
    expert = tile_expert.clamp(max=num_experts - 1)
    tile_start = offsets[expert] + (tile_ids - tile_end[expert] + tiles[expert]) * block_m
    return tile_expert, tile_start


def launch_grouped_swiglu(
    x: torch.Tensor,  # [T, H]
    routing: Routing,
    slot_of_expert: torch.Tensor,  # [E]
    out: torch.Tensor,  # [T, H] float32, added to in place
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # gate, up, down (dense or blocks)
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,  # MXFP4 scales, None = dense
    biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    intermediate_size: int,
    clamp: tuple[float, float] | None = None,
) -> None:
    """Run both stages on already-checked arguments (see the module docstring).

    `clamp` = (limit, alpha): gpt-oss's clamped SwiGLU; then gate and up (weights and biases) are
    one tensor each, [S, 2I, ...] with rows alternating gate, up, passed as both.
    """
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous; got strides {out.stride()}")
    num_tokens, hidden = x.shape
    top_k = routing.topk_ids.shape[1]
    num_assignments = num_tokens * top_k
    if num_assignments == 0:
        return
    num_experts = routing.num_experts
    mean_tokens = triton.cdiv(num_assignments, min(num_experts, num_assignments))
    block_m = min(64, max(16, triton.next_power_of_2(mean_tokens)))
    tile_expert, tile_start = _tile_table(routing, slot_of_expert, block_m)
    x = x.contiguous()
    sorted_assignments = routing.sorted_assignments.contiguous()  # [T*K]
    topk_weights = routing.topk_weights.contiguous()  # [T, K] float32
    slots = slot_of_expert.contiguous()
    gate, up, down = (w.contiguous() for w in weights)
    gate_scale, up_scale, down_scale = (gate, up, down) if scales is None else (s.contiguous() for s in scales)
    gate_bias, up_bias, down_bias = biases
    act = x.new_empty(num_assignments, intermediate_size)  # [T*K, I] in sorted order
    common = dict(
        TOP_K=top_k,
        MXFP4=scales is not None,
        BLOCK_M=block_m,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=os.environ.get("TRITON_INTERPRET") == "1" and x.dtype == torch.bfloat16,
    )
    block_i, block_h = _block(intermediate_size), _block(hidden)
    _gate_up_kernel[(tile_expert.numel(), triton.cdiv(intermediate_size, block_i))](
        x,
        sorted_assignments,
        tile_expert,
        tile_start,
        routing.expert_offsets,
        slots,
        gate,
        gate_scale,
        x if gate_bias is None else gate_bias,
        up,
        up_scale,
        x if up_bias is None else up_bias,
        act,
        num_experts,
        hidden,
        intermediate_size,
        0.0 if clamp is None else clamp[0],
        0.0 if clamp is None else clamp[1],
        CLAMPED=clamp is not None,
        HAS_GATE_BIAS=gate_bias is not None,
        HAS_UP_BIAS=up_bias is not None,
        BLOCK_N=block_i,
        BLOCK_K=block_h,
        **common,
    )
    _down_kernel[(tile_expert.numel(), triton.cdiv(hidden, block_h))](
        act,
        sorted_assignments,
        topk_weights,
        tile_expert,
        tile_start,
        routing.expert_offsets,
        slots,
        down,
        down_scale,
        x if down_bias is None else down_bias,
        out,
        num_experts,
        hidden,
        intermediate_size,
        HAS_DOWN_BIAS=down_bias is not None,
        BLOCK_N=block_h,
        BLOCK_K=block_i,
        **common,
    )


def grouped_swiglu_triton(
    x: torch.Tensor,  # [T, H]
    routing: Routing,
    gate: torch.Tensor,  # [S, I, H]
    up: torch.Tensor,  # [S, I, H]
    down: torch.Tensor,  # [S, H, I]
    slot_of_expert: torch.Tensor,  # [E] int64, -1 = skip
    out: torch.Tensor,  # [T, H] float32, added to in place
    *,
    gate_bias: torch.Tensor | None = None,  # [S, I]
    up_bias: torch.Tensor | None = None,  # [S, I]
    down_bias: torch.Tensor | None = None,  # [S, H]
) -> None:
    """Same contract as `grouped_swiglu_reference`."""
    biases = (gate_bias, up_bias, down_bias)
    check_dense_swiglu(
        x, routing, gate, up, down, slot_of_expert, out, dict(zip(("gate_bias", "up_bias", "down_bias"), biases))
    )
    launch_grouped_swiglu(x, routing, slot_of_expert, out, (gate, up, down), None, biases, gate.shape[1])
