"""Grouped expert SwiGLU in plain torch: down(silu(gate(x)) * up(x)) per routed expert.

Two implementations of one contract. `grouped_swiglu_reference` walks the routed experts
one by one (the readable oracle every other implementation is tested against);
`grouped_swiglu_torch` does the same work in three `grouped_mm` calls and is what runs off
CUDA. The Triton kernels in `pdflash.kernels.triton_swiglu` do it in one launch per matmul stage.
Also owns the shape checks that every implementation runs on its arguments.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdflash.kernels.routing import Routing


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
        raise ValueError(f"routing.topk_ids must be [T={num_tokens}, K]; got {tuple(routing.topk_ids.shape)}")
    if tuple(slot_of_expert.shape) != (routing.num_experts,):
        raise ValueError(f"slot_of_expert must be [E={routing.num_experts}]; got {tuple(slot_of_expert.shape)}")
    if tuple(out.shape) != (num_tokens, hidden) or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 [{num_tokens}, {hidden}]; got {out.dtype} {tuple(out.shape)}")
    sizes = {"gate_bias": intermediate_size, "up_bias": intermediate_size, "down_bias": hidden}
    for name, bias in biases.items():
        if bias is None:
            continue
        if tuple(bias.shape) != (num_slots, sizes[name]) or bias.dtype != x.dtype:
            raise ValueError(
                f"{name} must be {x.dtype} [S={num_slots}, {sizes[name]}]; got {bias.dtype} {tuple(bias.shape)}"
            )


def check_dense_weights(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
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


def check_dense_swiglu(x, routing, gate, up, down, slot_of_expert, out, biases: dict) -> None:
    """Every check a dense grouped SwiGLU runs: weights, routing, slots, out and biases."""
    check_dense_weights(x, gate, up, down)
    check_swiglu_args(
        x,
        routing,
        slot_of_expert,
        out,
        num_slots=gate.shape[0],
        intermediate_size=gate.shape[1],
        biases=biases,
    )


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
    biases = {"gate_bias": gate_bias, "up_bias": up_bias, "down_bias": down_bias}
    check_dense_swiglu(x, routing, gate, up, down, slot_of_expert, out, biases)
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


def grouped_swiglu_torch(
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
    """Same contract as `grouped_swiglu_reference`, with the assignments grouped by slot.

    On the CPU the reference's loop pays a few operator launches per routed expert; three
    grouped matmuls over all slots cost a fixed amount instead, which is less once a batch
    routes to about a third of the experts (`pdflash.kernels.dispatch.GROUPED_FROM_EXPERTS`).
    """
    biases = {"gate_bias": gate_bias, "up_bias": up_bias, "down_bias": down_bias}
    check_dense_swiglu(x, routing, gate, up, down, slot_of_expert, out, biases)
    num_slots, top_k = gate.shape[0], routing.topk_ids.shape[1]
    slot = slot_of_expert[routing.topk_ids.flatten()]  # [T*K] slot of each assignment, -1 = skipped
    slot = torch.where(slot < 0, num_slots, slot)  # skipped assignments sort after every slot
    slot, order = torch.sort(slot, stable=True)  # [A] assignments grouped by slot
    offsets = torch.cumsum(torch.bincount(slot, minlength=num_slots + 1)[:num_slots], 0, dtype=torch.int32)  # [S]
    tokens = order // top_k  # [A]
    h = x[tokens]  # [A, H]; rows past offsets[-1] (skipped) come out of grouped_mm undefined
    kept = slot.clamp(max=num_slots - 1)  # [A] a valid index for the bias gathers
    g = F.grouped_mm(h, gate.transpose(1, 2), offs=offsets)  # [A, I]
    u = F.grouped_mm(h, up.transpose(1, 2), offs=offsets)  # [A, I]
    if gate_bias is not None:
        g = g + gate_bias[kept]
    if up_bias is not None:
        u = u + up_bias[kept]
    y = F.grouped_mm(F.silu(g) * u, down.transpose(1, 2), offs=offsets)  # [A, H]
    if down_bias is not None:
        y = y + down_bias[kept]
    weighted = y.float() * routing.topk_weights.flatten()[order, None]  # [A, H]
    out.index_add_(0, tokens, torch.where(slot[:, None] < num_slots, weighted, 0.0))
