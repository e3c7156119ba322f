"""gpt-oss's clamped SwiGLU: the Triton kernels (CPU, TRITON_INTERPRET) equal the torch reference,
and the reference equals the formula written out token by token."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: run the kernels on the CPU

import pytest
import torch

from pdflash.kernels.clamped_swiglu import clamped_swiglu_reference, clamped_swiglu_triton
from pdflash.kernels.mxfp4 import pack_mxfp4, unpack_mxfp4
from pdflash.kernels.routing import permutation

LIMIT, ALPHA = 1.5, 1.702  # a low limit: the clamps bind for a good share of the values


def experts(num_slots: int, hidden: int, inter: int, mxfp4: bool, g: torch.Generator) -> dict:
    gate_up = torch.randn(num_slots, 2 * inter, hidden, generator=g) * 0.3  # [S, 2I, H]
    down = torch.randn(num_slots, hidden, inter, generator=g) * 0.3  # [S, H, I]
    tensors = {
        "gate_up_bias": torch.randn(num_slots, 2 * inter, generator=g),
        "down_bias": torch.randn(num_slots, hidden, generator=g),
    }
    if mxfp4:
        (gu, gus), (dn, dns) = pack_mxfp4(gate_up), pack_mxfp4(down)
        return tensors | {"gate_up": gu, "gate_up_scales": gus, "down": dn, "down_scales": dns}
    return tensors | {"gate_up": gate_up, "gate_up_scales": None, "down": down, "down_scales": None}


def run(impl, x, routing, w, slot_of_expert):
    out = torch.zeros(x.shape)
    impl(
        x,
        routing,
        w["gate_up"],
        w["gate_up_scales"],
        w["gate_up_bias"],
        w["down"],
        w["down_scales"],
        w["down_bias"],
        slot_of_expert,
        out,
        limit=LIMIT,
        alpha=ALPHA,
    )
    return out


def case(num_tokens: int, mxfp4: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    num_experts, top_k, hidden, inter = 6, 2, 64, 32
    top, ids = torch.topk(torch.randn(num_tokens, num_experts, generator=g), top_k, dim=-1)
    routing = permutation(ids, torch.softmax(top, dim=-1), num_experts)
    slot_of_expert = torch.tensor([3, -1, 0, 1, 2, -1])  # two experts absent from this wave
    return torch.randn(num_tokens, hidden, generator=g), routing, experts(4, hidden, inter, mxfp4, g), slot_of_expert


@pytest.mark.parametrize("mxfp4", [True, False], ids=["mxfp4", "dense"])
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_triton_matches_reference(num_tokens, mxfp4):
    x, routing, w, slots = case(num_tokens, mxfp4)
    torch.testing.assert_close(
        run(clamped_swiglu_triton, x, routing, w, slots),
        run(clamped_swiglu_reference, x, routing, w, slots),
        atol=1e-4,
        rtol=1e-4,
    )


def test_reference_is_the_formula_token_by_token():
    x, routing, w, slots = case(5, mxfp4=True, seed=1)
    gate_up = unpack_mxfp4(w["gate_up"], w["gate_up_scales"], torch.float32)  # [S, 2I, H]
    down = unpack_mxfp4(w["down"], w["down_scales"], torch.float32)  # [S, H, I]
    expected = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for k in range(routing.topk_ids.shape[1]):
            slot = int(slots[routing.topk_ids[t, k]])
            if slot < 0:
                continue
            gu = gate_up[slot] @ x[t] + w["gate_up_bias"][slot]  # [2I]
            gate, up = gu[0::2].clamp(max=LIMIT), gu[1::2].clamp(-LIMIT, LIMIT)
            y = down[slot] @ ((up + 1) * gate * torch.sigmoid(ALPHA * gate)) + w["down_bias"][slot]
            expected[t] += routing.topk_weights[t, k] * y
    torch.testing.assert_close(run(clamped_swiglu_reference, x, routing, w, slots), expected, atol=1e-5, rtol=1e-5)


def test_gpt_oss_logits_with_triton_path_equal_reference_path(tmp_path, monkeypatch):
    from pdflash.target.loader import load_target
    from pdflash.target.tiny_gpt_oss import write_tiny_gpt_oss

    model = load_target(write_tiny_gpt_oss(tmp_path / "g", with_tokenizer=False)).model
    prompts = [torch.arange(3, 14), torch.tensor([7]), torch.arange(40, 46)]
    monkeypatch.setenv("PDFLASH_KERNELS", "torch")
    reference = model.forward(prompts, [model.new_cache() for _ in prompts])
    monkeypatch.setenv("PDFLASH_KERNELS", "triton")
    forced = model.forward(prompts, [model.new_cache() for _ in prompts])
    torch.testing.assert_close(forced.logits, reference.logits, atol=1e-4, rtol=1e-4)
