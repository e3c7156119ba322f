"""gpt-oss expert MLPs in plain torch: the clamped SwiGLU over interleaved gate/up rows, with biases.

    gu = x W_guᵀ + b_gu                      # [n, 2I], rows alternate gate, up
    gate = min(gu[0::2], limit);  up = clamp(gu[1::2], -limit, limit)
    y = ((up + 1) * gate * sigmoid(alpha * gate)) W_downᵀ + b_down

The weights of a slot are either dense ([2I, H], [H, I]) or MXFP4 blocks with their scales,
dequantized to x's dtype here, one routed expert at a time (so a wave never expands whole).
`clamped_swiglu_triton` runs the same on the Triton kernels of `triton_swiglu` (blocks decoded
in registers); `pdflash.kernels.dispatch.clamped_swiglu` picks between them.
"""

from __future__ import annotations

import torch

from pdflash.kernels.mxfp4 import unpack_mxfp4
from pdflash.kernels.routing import Routing


def clamped_swiglu_reference(
    x: torch.Tensor,  # [T, H]
    routing: Routing,
    gate_up: torch.Tensor,  # [S, 2I, H] dense, or [S, 2I, H/32, 16] uint8 MXFP4 blocks
    gate_up_scales: torch.Tensor | None,  # [S, 2I, H/32] uint8; None = dense
    gate_up_bias: torch.Tensor,  # [S, 2I]
    down: torch.Tensor,  # [S, H, I] dense, or [S, H, I/32, 16] uint8
    down_scales: torch.Tensor | None,  # [S, H, I/32] uint8; None = dense
    down_bias: torch.Tensor,  # [S, H]
    slot_of_expert: torch.Tensor,  # [E] int64 slot of expert e, -1 = not in this call
    out: torch.Tensor,  # [T, H] float32, added to in place
    *,
    limit: float,
    alpha: float,
) -> None:
    if tuple(out.shape) != tuple(x.shape) or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 {tuple(x.shape)}; got {out.dtype} {tuple(out.shape)}")
    if tuple(slot_of_expert.shape) != (routing.num_experts,):
        raise ValueError(f"slot_of_expert must be [E={routing.num_experts}]; got {tuple(slot_of_expert.shape)}")
    top_k = routing.topk_ids.shape[1]
    offsets = routing.expert_offsets.tolist()
    slots = slot_of_expert.tolist()
    order = routing.sorted_assignments  # [A] assignments grouped by expert
    tokens = order // top_k  # [A]
    h_all = x[tokens]  # [A, H]
    y_all = torch.zeros(h_all.shape, dtype=torch.float32, device=x.device)  # [A, H]
    for expert in routing.union_ids().tolist():
        slot = slots[expert]
        if slot < 0:
            continue
        lo, hi = offsets[expert], offsets[expert + 1]
        w_gu = gate_up[slot] if gate_up_scales is None else unpack_mxfp4(gate_up[slot], gate_up_scales[slot], x.dtype)
        w_down = down[slot] if down_scales is None else unpack_mxfp4(down[slot], down_scales[slot], x.dtype)
        gu = h_all[lo:hi] @ w_gu.to(x.dtype).T + gate_up_bias[slot].to(x.dtype)  # [n, 2I]
        gate = gu[:, 0::2].clamp(max=limit)  # [n, I]
        up = gu[:, 1::2].clamp(min=-limit, max=limit)  # [n, I]
        act = (up + 1) * (gate * torch.sigmoid(gate * alpha))  # [n, I]
        y_all[lo:hi] = act @ w_down.to(x.dtype).T + down_bias[slot].to(x.dtype)  # [n, H]
    out.index_add_(0, tokens, y_all * routing.topk_weights.flatten()[order, None])  # skipped experts add 0


def clamped_swiglu_triton(
    x: torch.Tensor,
    routing: Routing,
    gate_up: torch.Tensor,
    gate_up_scales: torch.Tensor | None,
    gate_up_bias: torch.Tensor,
    down: torch.Tensor,
    down_scales: torch.Tensor | None,
    down_bias: torch.Tensor,
    slot_of_expert: torch.Tensor,
    out: torch.Tensor,
    *,
    limit: float,
    alpha: float,
) -> None:
    """Same contract as `clamped_swiglu_reference`; MXFP4 blocks are decoded inside the GEMMs."""
    from pdflash.kernels.triton_swiglu import launch_grouped_swiglu  # lazy: needs triton

    if tuple(out.shape) != tuple(x.shape) or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 {tuple(x.shape)}; got {out.dtype} {tuple(out.shape)}")
    inter = down.shape[2] * (32 if down_scales is not None else 1)
    scales = None if gate_up_scales is None else (gate_up_scales, gate_up_scales, down_scales)
    launch_grouped_swiglu(
        x,
        routing,
        slot_of_expert,
        out,
        (gate_up, gate_up, down),
        scales,
        (gate_up_bias.to(x.dtype), gate_up_bias.to(x.dtype), down_bias.to(x.dtype)),
        inter,
        clamp=(limit, alpha),
    )
