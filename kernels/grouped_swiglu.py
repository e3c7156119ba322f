"""Grouped expert SwiGLU, plain-torch reference: down(silu(gate(x)) * up(x)) per expert.

The reference walks the routed experts (the union, not all experts); the Triton kernels in
`kernels.triton_swiglu` do the same work in one launch per matmul stage. Also owns the shape
checks that every implementation runs on its arguments.
"""

from __future__ import annotations

import torch

from kernels.routing import Routing


def check_swiglu_args(
    x: torch.Tensor,
    routing: Routing,
    slot_of_expert: torch.Tensor,
    out: torch.Tensor,
    *,
    num_slots: int,
    intermediate_size: int,
    biases: dict[str, torch.Tensor | None],
) -> None:
    """Raise ValueError unless the activations, routing, slots, out and biases agree in shape."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H]; got shape {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if routing.topk_ids.dim() != 2 or routing.topk_ids.shape[0] != num_tokens:
        raise ValueError(
            f"routing.topk_ids must be [T={num_tokens}, K]; got {tuple(routing.topk_ids.shape)}"
        )
    if tuple(slot_of_expert.shape) != (routing.num_experts,):
        raise ValueError(
            f"slot_of_expert must be [E={routing.num_experts}]; got {tuple(slot_of_expert.shape)}"
        )
    if tuple(out.shape) != (num_tokens, hidden) or out.dtype != torch.float32:
        raise ValueError(
            f"out must be float32 [{num_tokens}, {hidden}]; got {out.dtype} {tuple(out.shape)}"
        )
    sizes = {"gate_bias": intermediate_size, "up_bias": intermediate_size, "down_bias": hidden}
    for name, bias in biases.items():
        if bias is None:
            continue
        if tuple(bias.shape) != (num_slots, sizes[name]) or bias.dtype != x.dtype:
            raise ValueError(
                f"{name} must be {x.dtype} [S={num_slots}, {sizes[name]}]; "
                f"got {bias.dtype} {tuple(bias.shape)}"
            )


def check_dense_weights(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> None:
    """Raise ValueError unless gate/up are [S, I, H] and down [S, H, I] in x's dtype."""
    hidden = x.shape[-1]
    if gate.dim() != 3 or gate.shape[2] != hidden:
        raise ValueError(f"gate must be [S, I, H={hidden}]; got {tuple(gate.shape)}")
    slots, inter, _ = gate.shape
    if tuple(up.shape) != (slots, inter, hidden):
        raise ValueError(f"up must be [{slots}, {inter}, {hidden}] as gate; got {tuple(up.shape)}")
    if tuple(down.shape) != (slots, hidden, inter):
        raise ValueError(f"down must be [{slots}, {hidden}, {inter}]; got {tuple(down.shape)}")
    for name, weight in (("gate", gate), ("up", up), ("down", down)):
        if weight.dtype != x.dtype:
            raise ValueError(f"{name} dtype {weight.dtype} differs from x dtype {x.dtype}")


def grouped_swiglu_reference(
    x: torch.Tensor,  # [T, H] hidden states of the batch
    routing: Routing,
    gate: torch.Tensor,  # [S, I, H] expert weights by slot
    up: torch.Tensor,  # [S, I, H]
    down: torch.Tensor,  # [S, H, I]
    slot_of_expert: torch.Tensor,  # [E] int64 slot holding expert e, -1 = not in this call
    out: torch.Tensor,  # [T, H] float32 accumulator, added to in place
    *,
    gate_bias: torch.Tensor | None = None,  # [S, I]
    up_bias: torch.Tensor | None = None,  # [S, I]
    down_bias: torch.Tensor | None = None,  # [S, H]
) -> None:
    check_dense_weights(x, gate, up, down)
    biases = {"gate_bias": gate_bias, "up_bias": up_bias, "down_bias": down_bias}
    check_swiglu_args(
        x, routing, slot_of_expert, out,
        num_slots=gate.shape[0], intermediate_size=gate.shape[1], biases=biases,
    )
    top_k = routing.topk_ids.shape[1]
    offsets = routing.expert_offsets.tolist()
    slots = slot_of_expert.tolist()
    order = routing.sorted_assignments  # [A] assignments grouped by expert
    tokens = order // top_k  # [A]
    h_all = x[tokens]  # [A, H] gathered once; each expert reads a contiguous slice
    y_all = torch.zeros(h_all.shape, dtype=torch.float32, device=x.device)  # [A, H]
    for expert in routing.union_ids().tolist():
        slot = slots[expert]
        if slot < 0:
            continue
        lo, hi = offsets[expert], offsets[expert + 1]
        h = h_all[lo:hi]  # [n, H]
        g = h @ gate[slot].T  # [n, I]
        u = h @ up[slot].T  # [n, I]
        if gate_bias is not None:
            g = g + gate_bias[slot]
        if up_bias is not None:
            u = u + up_bias[slot]
        y = (torch.nn.functional.silu(g) * u) @ down[slot].T  # [n, H]
        if down_bias is not None:
            y = y + down_bias[slot]
        y_all[lo:hi] = y
    out.index_add_(0, tokens, y_all * routing.topk_weights.flatten()[order, None])  # skipped experts add 0
