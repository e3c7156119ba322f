"""The Triton kernels compiled for the GPU (not interpreted) equal their torch references over
ragged routings, at toy shapes and at the real expert shapes of Qwen3-30B-A3B and gpt-oss."""

import pytest
import torch
from kernel_cases import (
    DTYPES,
    assert_close_to_reference,
    distinct_logits,
    expert_weights,
    mxfp4_experts,
    ragged_routing,
    slots_for,
    to_device,
)

from pdflash.kernels.grouped_swiglu import grouped_swiglu_reference
from pdflash.kernels.mxfp4 import mxfp4_grouped_swiglu_reference, mxfp4_grouped_swiglu_triton
from pdflash.kernels.routing import route_reference

pytestmark = pytest.mark.cuda


def test_kernels_are_compiled_not_interpreted(cuda_only):
    from triton.runtime.jit import JITFunction

    from pdflash.kernels import triton_routing, triton_swiglu

    kernels = (triton_routing._softmax_topk_kernel, triton_swiglu._gate_up_kernel, triton_swiglu._down_kernel)
    for kernel in kernels:
        assert isinstance(kernel, JITFunction), (
            f"{kernel!r} is interpreted: run tests/cuda in their own session with TRITON_INTERPRET unset or 0"
        )


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "normalize", "dtype"),
    [
        (1, 128, 8, True, torch.float32),  # Qwen3-30B-A3B decode
        (8, 128, 8, True, torch.bfloat16),  # one verify block of 8
        (256, 128, 8, True, torch.float32),  # 32 verify blocks of 8
        (37, 32, 4, True, torch.float16),  # gpt-oss-20b routing width, ragged token count
        (9, 256, 8, False, torch.float32),
        (33, 60, 3, True, torch.bfloat16),
        (0, 16, 2, True, torch.float32),
    ],
)
def test_route_on_cuda_matches_the_cpu_reference(device, num_tokens, num_experts, top_k, normalize, dtype):
    from pdflash.kernels.triton_routing import route_triton

    torch.manual_seed(num_tokens * 1000 + num_experts)
    if dtype == torch.float32:
        logits = torch.randn(num_tokens, num_experts) * 3
    else:
        logits = distinct_logits(num_tokens, num_experts, dtype)  # no ties: one right answer
    want = route_reference(logits, top_k, normalize)
    got = route_triton(logits.to(device), top_k, normalize)
    assert got.topk_ids.device.type == device.type
    assert torch.equal(got.topk_ids.cpu(), want.topk_ids)
    assert torch.equal(got.expert_offsets.cpu(), want.expert_offsets)
    assert torch.equal(got.sorted_assignments.cpu(), want.sorted_assignments)
    torch.testing.assert_close(got.topk_weights.cpu(), want.topk_weights, rtol=0, atol=1e-6)


# (tokens, experts, top-k, hidden, intermediate): toy ragged shapes, then Qwen3-30B-A3B experts
# (H=2048, I=768, 128 experts, top-8) at one decode token and at 32 verify blocks of 8
SWIGLU_SHAPES = [(41, 12, 3, 64, 96), (3, 12, 3, 48, 32), (1, 128, 8, 2048, 768), (256, 128, 8, 2048, 768)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "hidden", "inter"), SWIGLU_SHAPES)
def test_grouped_swiglu_on_cuda_matches_the_reference(device, dtype, num_tokens, num_experts, top_k, hidden, inter):
    from pdflash.kernels.triton_swiglu import grouped_swiglu_triton

    torch.manual_seed(num_tokens)
    routing = to_device(ragged_routing(num_tokens, num_experts, top_k), device)
    slot_of_expert, num_slots = slots_for(num_experts, skipped=[3, 7])
    x = torch.randn(num_tokens, hidden).to(dtype).to(device)  # [T, H]
    gate, up, down = expert_weights(num_slots, hidden, inter, dtype, device)
    start = torch.randn(num_tokens, hidden, device=device)  # out is accumulated into, not overwritten
    want, got = start.clone(), start.clone()
    slot_of_expert = slot_of_expert.to(device)
    grouped_swiglu_reference(x, routing, gate, up, down, slot_of_expert, want)
    grouped_swiglu_triton(x, routing, gate, up, down, slot_of_expert, got)
    assert_close_to_reference((got - start).cpu(), (want - start).cpu(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_biases", [False, True])
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "inter"),
    [(37, 12, 3, 64, 96), (64, 32, 4, 2880, 2880)],  # toy, then gpt-oss experts (H=I=2880: tiles are ragged)
)
def test_mxfp4_swiglu_on_cuda_matches_dequantize_then_reference(
    device, dtype, with_biases, num_tokens, num_experts, top_k, hidden, inter
):
    torch.manual_seed(7)
    routing = to_device(ragged_routing(num_tokens, num_experts, top_k), device)
    slot_of_expert, num_slots = slots_for(num_experts, skipped=[2, 9])
    x = torch.randn(num_tokens, hidden).to(dtype).to(device)
    experts = mxfp4_experts(num_slots, hidden, inter, device)
    biases = [
        torch.randn(num_slots, size).to(dtype).to(device) if with_biases else None for size in (inter, inter, hidden)
    ]
    want = torch.zeros(num_tokens, hidden, device=device)
    got = torch.zeros(num_tokens, hidden, device=device)
    slot_of_expert = slot_of_expert.to(device)
    mxfp4_grouped_swiglu_reference(x, routing, *experts, slot_of_expert, want, *biases)
    mxfp4_grouped_swiglu_triton(x, routing, *experts, slot_of_expert, got, *biases)
    assert_close_to_reference(got.cpu(), want.cpu(), dtype)
