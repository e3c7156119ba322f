"""Triton kernels against their torch references (CPU, TRITON_INTERPRET), MXFP4 format, dispatch."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: run the kernels on the CPU

import subprocess
import sys

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
)

from pdflash import kernels
from pdflash.kernels.dispatch import backend
from pdflash.kernels.grouped_swiglu import grouped_swiglu_reference, grouped_swiglu_torch
from pdflash.kernels.mxfp4 import (
    FP4_VALUES,
    mxfp4_expert_layout,
    mxfp4_expert_nbytes,
    mxfp4_grouped_swiglu_reference,
    mxfp4_grouped_swiglu_triton,
    pack_mxfp4,
    payload_nbytes,
    unpack_mxfp4,
)
from pdflash.kernels.routing import route_reference
from pdflash.kernels.triton_routing import route_triton
from pdflash.kernels.triton_swiglu import grouped_swiglu_triton

# ---------------------------------------------------------------- routing


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "normalize", "dtype"),
    [
        (1, 8, 2, True, torch.float32),
        (37, 16, 4, False, torch.float32),
        (50, 128, 8, True, torch.float32),
        (9, 256, 8, False, torch.float32),
        (33, 60, 3, True, torch.bfloat16),
        (6, 4, 4, True, torch.float16),
        (0, 16, 2, True, torch.float32),
    ],
)
def test_route_triton_matches_reference(num_tokens, num_experts, top_k, normalize, dtype):
    torch.manual_seed(num_tokens * 1000 + num_experts)
    if dtype == torch.float32:
        logits = torch.randn(num_tokens, num_experts) * 3
    else:
        logits = distinct_logits(num_tokens, num_experts, dtype)
    want = route_reference(logits, top_k, normalize)
    got = route_triton(logits, top_k, normalize)
    assert torch.equal(got.topk_ids, want.topk_ids)
    assert got.topk_ids.dtype == torch.int64 and got.topk_weights.dtype == torch.float32
    assert torch.equal(got.expert_offsets, want.expert_offsets)
    assert torch.equal(got.sorted_assignments, want.sorted_assignments)
    assert torch.allclose(got.topk_weights, want.topk_weights, rtol=0, atol=1e-6)


def test_route_triton_rejects_bad_arguments():
    with pytest.raises(ValueError, match="top_k must be in 1..E=4; got 5"):
        route_triton(torch.randn(3, 4), 5, True)
    with pytest.raises(ValueError, match=r"\[T, E\]; got shape \(12,\)"):
        route_triton(torch.randn(12), 2, True)


# ---------------------------------------------------------------- grouped SwiGLU


SWIGLU_IMPLS = {"triton": grouped_swiglu_triton, "grouped_mm": grouped_swiglu_torch}


@pytest.mark.parametrize("impl", SWIGLU_IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "hidden", "inter"), [(41, 64, 96), (3, 48, 32)])
def test_grouped_swiglu_matches_reference_on_ragged_routing(impl, dtype, num_tokens, hidden, inter):
    torch.manual_seed(num_tokens)
    num_experts, top_k = 12, 3
    routing = ragged_routing(num_tokens, num_experts, top_k)
    slot_of_expert, num_slots = slots_for(num_experts, skipped=[3, 7])
    x = torch.randn(num_tokens, hidden).to(dtype)  # [T, H]
    gate, up, down = expert_weights(num_slots, hidden, inter, dtype)
    start = torch.randn(num_tokens, hidden)  # [T, H] out is accumulated into, not overwritten
    want, got = start.clone(), start.clone()
    grouped_swiglu_reference(x, routing, gate, up, down, slot_of_expert, want)
    SWIGLU_IMPLS[impl](x, routing, gate, up, down, slot_of_expert, got)
    assert_close_to_reference(got - start, want - start, dtype)


@pytest.mark.parametrize("impl", SWIGLU_IMPLS)
def test_grouped_swiglu_matches_reference_with_biases_and_routed_tokens(impl):
    torch.manual_seed(1)
    num_tokens, num_experts, top_k, hidden, inter = 20, 8, 2, 32, 64
    routing = route_reference(torch.randn(num_tokens, num_experts), top_k, normalize=True)
    slot_of_expert, num_slots = slots_for(num_experts, skipped=[0])
    x = torch.randn(num_tokens, hidden)
    gate, up, down = expert_weights(num_slots, hidden, inter, torch.float32)
    biases = {
        "gate_bias": torch.randn(num_slots, inter),
        "up_bias": torch.randn(num_slots, inter),
        "down_bias": torch.randn(num_slots, hidden),
    }
    want, got = torch.zeros(num_tokens, hidden), torch.zeros(num_tokens, hidden)
    grouped_swiglu_reference(x, routing, gate, up, down, slot_of_expert, want, **biases)
    SWIGLU_IMPLS[impl](x, routing, gate, up, down, slot_of_expert, got, **biases)
    assert_close_to_reference(got, want, torch.float32)


def test_grouped_swiglu_rejects_bad_shapes():
    routing = route_reference(torch.randn(4, 6), 2, normalize=True)
    x = torch.randn(4, 32)
    gate, up, down = expert_weights(6, 32, 16, torch.float32)
    slots = torch.arange(6)
    with pytest.raises(ValueError, match=r"gate must be \[S, I, H=32\]; got \(6, 16, 31\)"):
        grouped_swiglu_triton(x, routing, gate[..., :31], up, down, slots, torch.zeros(4, 32))
    with pytest.raises(ValueError, match=r"slot_of_expert must be \[E=6\]; got \(5,\)"):
        grouped_swiglu_triton(x, routing, gate, up, down, slots[:5], torch.zeros(4, 32))
    with pytest.raises(ValueError, match=r"out must be float32 \[4, 32\]; got torch.bfloat16"):
        grouped_swiglu_triton(x, routing, gate, up, down, slots, torch.zeros(4, 32, dtype=torch.bfloat16))


# ---------------------------------------------------------------- MXFP4 format

REPRESENTABLE = torch.tensor(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 0] * 2
)  # [32] every FP4 value; max |value| 6


@pytest.mark.parametrize("k", [-127, -3, 0, 5, 125])  # the scale range float32 can hold
def test_pack_round_trips_representable_values_and_picks_the_scale(k):
    w = torch.stack([REPRESENTABLE, REPRESENTABLE.flip(0)]) * 2.0**k  # [2, 32]
    blocks, scales = pack_mxfp4(w)
    assert blocks.shape == (2, 1, 16) and blocks.dtype == torch.uint8
    assert scales.tolist() == [[127 + k]] * 2
    assert blocks[0, 0, 0].item() == 0x10  # codes 0 (value 0) low nibble, 1 (value 0.5) high
    assert blocks[0, 0, 4].item() == 0xA9  # -0.5 (code 9) low nibble, -1 (code 10) high
    assert torch.equal(unpack_mxfp4(blocks, scales, torch.float32), w)


@pytest.mark.parametrize(
    ("block_max", "scale_byte"), [(6.0, 127), (6.01, 128), (7.0, 128), (3.0, 126), (12.0, 128), (0.75, 124), (0.0, 0)]
)
def test_pack_chooses_the_smallest_scale_that_fits(block_max, scale_byte):
    w = torch.full((32,), block_max / 4)
    w[5] = -block_max
    _, scales = pack_mxfp4(w)
    assert scales.item() == scale_byte


def test_pack_rounds_to_nearest_code_ties_to_even():
    values = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 2.6, 0.2, 5.1, -1.25, -0.1]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 3.0, 0.0, 6.0, -1.0, 0.0]
    w = torch.tensor(values + [6.0] * 20)  # the 6 pins the scale to 2^0
    got = unpack_mxfp4(*pack_mxfp4(w), torch.float32)
    assert got[: len(values)].tolist() == want


def test_pack_picks_a_nearest_code_on_random_values():
    torch.manual_seed(0)
    w = torch.randn(4, 8, 64) * torch.logspace(-3, 3, 8)[None, :, None]  # [4, 8, 64]
    blocks, scales = pack_mxfp4(w)
    assert blocks.shape == (4, 8, 2, 16) and scales.shape == (4, 8, 2)
    got = unpack_mxfp4(blocks, scales, torch.float32)
    scale = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)  # [4, 8, 64]
    candidates = torch.tensor(FP4_VALUES) * scale[..., None]  # [4, 8, 64, 16]
    nearest = (candidates - w[..., None]).abs().amin(dim=-1)
    assert torch.equal((got - w).abs(), nearest)
    assert unpack_mxfp4(blocks, scales).dtype == torch.bfloat16


def test_mxfp4_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"K a multiple of 32; got shape \(2, 33\)"):
        pack_mxfp4(torch.zeros(2, 33))
    blocks, scales = pack_mxfp4(torch.zeros(2, 64))
    with pytest.raises(ValueError, match=r"scales must be uint8 \(2, 2\); got torch.uint8 \(2, 1"):
        unpack_mxfp4(blocks, scales[:, :1])
    with pytest.raises(ValueError, match="intermediate_size must be a positive multiple of 32"):
        mxfp4_expert_nbytes(64, 40)


def test_mxfp4_expert_nbytes_is_the_sum_over_the_expert_tensors():
    hidden, inter = 64, 96
    gate_blocks, gate_scales = pack_mxfp4(torch.randn(inter, hidden))
    up_blocks, up_scales = pack_mxfp4(torch.randn(inter, hidden))
    down_blocks, down_scales = pack_mxfp4(torch.randn(hidden, inter))
    quantized = [gate_blocks, gate_scales, up_blocks, up_scales, down_blocks, down_scales]
    biases = [torch.zeros(size, dtype=torch.bfloat16) for size in (inter, inter, hidden)]
    assert mxfp4_expert_nbytes(hidden, inter, bias_dtype=None) == sum(t.numel() * t.element_size() for t in quantized)
    assert mxfp4_expert_nbytes(hidden, inter) == payload_nbytes(*quantized, *biases)
    layout = mxfp4_expert_layout(hidden, inter)
    assert [tuple(shape) for shape, _ in layout.values()] == [tuple(t.shape) for t in quantized + biases]
    # gpt-oss-120b: H = I = 2880, bf16 biases
    assert mxfp4_expert_nbytes(2880, 2880) == 3 * 2880 * 90 * 17 + 3 * 2880 * 2


# ---------------------------------------------------------------- MXFP4 grouped SwiGLU


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_biases", [False, True])
def test_mxfp4_triton_matches_dequantize_then_reference(dtype, with_biases):
    torch.manual_seed(7)
    num_tokens, num_experts, top_k, hidden, inter = 37, 12, 3, 64, 96
    routing = ragged_routing(num_tokens, num_experts, top_k)
    slot_of_expert, num_slots = slots_for(num_experts, skipped=[2, 9])
    x = torch.randn(num_tokens, hidden).to(dtype)
    experts = mxfp4_experts(num_slots, hidden, inter)
    biases = [torch.randn(num_slots, size).to(dtype) if with_biases else None for size in (inter, inter, hidden)]
    want, got = torch.zeros(num_tokens, hidden), torch.zeros(num_tokens, hidden)
    mxfp4_grouped_swiglu_reference(x, routing, *experts, slot_of_expert, want, *biases)
    mxfp4_grouped_swiglu_triton(x, routing, *experts, slot_of_expert, got, *biases)
    assert_close_to_reference(got, want, dtype)


def test_mxfp4_reference_is_dense_reference_on_dequantized_weights():
    torch.manual_seed(3)
    routing = route_reference(torch.randn(5, 4), 2, normalize=False)
    x = torch.randn(5, 32)
    experts = mxfp4_experts(4, 32, 64)
    dense = [unpack_mxfp4(b, s, torch.float32) for b, s in zip(experts[::2], experts[1::2])]
    want, got = torch.zeros(5, 32), torch.zeros(5, 32)
    grouped_swiglu_reference(x, routing, *dense, torch.arange(4), want)
    mxfp4_grouped_swiglu_reference(x, routing, *experts, torch.arange(4), got)
    assert torch.equal(got, want)


def test_mxfp4_swiglu_rejects_bad_shapes():
    routing = route_reference(torch.randn(3, 4), 2, normalize=False)
    experts = mxfp4_experts(4, 32, 64)
    experts[3] = experts[3][:, :, :0]  # up_scales [S, I, 0]
    with pytest.raises(ValueError, match=r"up_scales must be torch.uint8 \(4, 64, 1\) for H=32"):
        mxfp4_grouped_swiglu_triton(torch.randn(3, 32), routing, *experts, torch.arange(4), torch.zeros(3, 32))


# ---------------------------------------------------------------- dispatch


def test_backend_rejects_unknown_setting(monkeypatch):
    monkeypatch.setenv("PDFLASH_KERNELS", "bogus")
    with pytest.raises(ValueError, match="PDFLASH_KERNELS='bogus'"):
        backend(torch.device("cpu"))


def test_backend_auto_picks_torch_on_cpu(monkeypatch):
    monkeypatch.delenv("PDFLASH_KERNELS", raising=False)
    assert backend(torch.device("cpu")) == "torch"
    monkeypatch.setenv("PDFLASH_KERNELS", "auto")
    assert backend(torch.device("cpu")) == "torch"
    assert backend(torch.device("cuda")) == "triton"


@pytest.mark.parametrize("setting", ["triton", "torch"])
@pytest.mark.parametrize("num_experts", [6, 40])  # 40: the union passes GROUPED_FROM_EXPERTS
def test_dispatch_runs_the_chosen_backend(monkeypatch, setting, num_experts):
    monkeypatch.setenv("PDFLASH_KERNELS", setting)
    torch.manual_seed(5)
    num_tokens, hidden, inter = 30, 32, 32
    logits = torch.randn(num_tokens, num_experts)
    routing = kernels.route(logits, 2, True)
    want_routing = route_reference(logits, 2, True)
    assert torch.equal(routing.sorted_assignments, want_routing.sorted_assignments)
    assert (int(routing.union_mask.sum()) >= kernels.dispatch.GROUPED_FROM_EXPERTS) == (num_experts == 40)
    slot_of_expert = torch.arange(num_experts)
    x = torch.randn(num_tokens, hidden)
    dense = expert_weights(num_experts, hidden, inter, torch.float32)
    want, got = torch.zeros(num_tokens, hidden), torch.zeros(num_tokens, hidden)
    grouped_swiglu_reference(x, want_routing, *dense, slot_of_expert, want)
    kernels.grouped_swiglu(x, routing, *dense, slot_of_expert, got)
    assert_close_to_reference(got, want, torch.float32)
    experts = mxfp4_experts(num_experts, hidden, inter)
    want, got = torch.zeros(num_tokens, hidden), torch.zeros(num_tokens, hidden)
    mxfp4_grouped_swiglu_reference(x, want_routing, *experts, slot_of_expert, want)
    kernels.mxfp4_grouped_swiglu(x, routing, *experts, slot_of_expert, got)
    assert_close_to_reference(got, want, torch.float32)


def test_import_kernels_does_not_import_triton():
    code = "import sys, pdflash.kernels; sys.exit('triton' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


def test_model_logits_with_triton_path_equal_reference_path(tiny_target, monkeypatch):
    from pdflash.target.loader import load_target

    model = load_target(tiny_target).model
    prompts = [torch.arange(3, 14), torch.tensor([7]), torch.arange(40, 46)]
    monkeypatch.setenv("PDFLASH_KERNELS", "torch")
    reference = model.forward(prompts, [model.new_cache() for _ in prompts])
    monkeypatch.setenv("PDFLASH_KERNELS", "triton")
    forced = model.forward(prompts, [model.new_cache() for _ in prompts])
    torch.testing.assert_close(forced.logits, reference.logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(forced.routed, reference.routed)
