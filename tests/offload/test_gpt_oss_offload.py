"""gpt-oss experts offloaded: MXFP4 on the host, on the link and in the arena; the byte map as stored."""

import json
import struct

import pytest
import torch
from safetensors.torch import load_file

from pdflash.offload import load_offloaded_target
from pdflash.sampling import SamplingParams
from pdflash.target.generate import generate_autoregressive
from pdflash.target.gpt_oss_layout import config_byte_map
from pdflash.target.loader import load_target
from pdflash.target.tiny_gpt_oss import TINY_GPT_OSS_CONFIG, write_tiny_gpt_oss

PROMPT = [5, 9, 14, 200, 31, 77, 3, 18, 40, 41, 42, 120]
EXPERT_SUFFIXES = {
    "mxfp4": ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias")
    + ("down_proj_blocks", "down_proj_scales", "down_proj_bias"),
    "dequantized": ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
}


@pytest.fixture(scope="module", params=sorted(EXPERT_SUFFIXES))
def checkpoint(request, tmp_path_factory):
    form = request.param
    return form, write_tiny_gpt_oss(tmp_path_factory.mktemp(form), mxfp4=form == "mxfp4")


def header(path):
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length))


def test_byte_map_is_the_stored_expert_payload(checkpoint):
    form, directory = checkpoint
    entries = header(directory / "model.safetensors")
    E = TINY_GPT_OSS_CONFIG["num_local_experts"]
    loaded = load_target(directory)
    for layer in range(TINY_GPT_OSS_CONFIG["num_hidden_layers"]):
        spans = [entries[f"model.layers.{layer}.mlp.experts.{s}"]["data_offsets"] for s in EXPERT_SUFFIXES[form]]
        per_expert = sum(end - start for start, end in spans) // E
        assert all(loaded.expert_nbytes[(layer, e)] == per_expert for e in range(E))
    if form == "mxfp4":  # biases stored bf16, as published: the closed form from the config alone
        assert loaded.expert_nbytes == config_byte_map(loaded.model.config)


def test_host_experts_are_their_slices_of_the_stacked_tensors(checkpoint):
    form, directory = checkpoint
    offloaded = load_offloaded_target(directory, expert_cache_fraction=0.1)
    store = offloaded.model.experts.store
    tensors = load_file(directory / "model.safetensors")
    prefix = "model.layers.2.mlp.experts."
    expert = store.expert((2, 5)).stored
    if form == "mxfp4":
        assert torch.equal(expert["gate_up"], tensors[prefix + "gate_up_proj_blocks"][5])
        assert torch.equal(expert["down_scales"], tensors[prefix + "down_proj_scales"][5])
    else:
        assert torch.equal(expert["gate_up"], tensors[prefix + "gate_up_proj"][5].T)
    assert store.nbytes((2, 5)) == offloaded.expert_nbytes[(2, 5)]
    offloaded.model.experts.close()


def test_offloaded_at_a_tenth_equals_resident(checkpoint):
    form, directory = checkpoint
    resident = load_target(directory).model
    offloaded = load_offloaded_target(directory, expert_cache_fraction=0.1)
    provider = offloaded.model.experts
    try:
        assert provider.num_slots < len(provider.store.keys) // 5
        if form == "mxfp4":  # the arena holds experts as stored: packed blocks and E8M0 scales
            assert (
                provider.arena.tensors["gate_up"].dtype == torch.uint8
                and provider.arena.tensors["down_scales"].dtype == torch.uint8
            )
        expected = resident.forward([torch.tensor(PROMPT)], [resident.new_cache()]).logits
        got = offloaded.model.forward([torch.tensor(PROMPT)], [offloaded.model.new_cache()]).logits
        assert torch.equal(got, expected)
        greedy = SamplingParams(max_tokens=24)
        assert (
            generate_autoregressive(offloaded.model, PROMPT, greedy).token_ids
            == generate_autoregressive(resident, PROMPT, greedy).token_ids
        )
        stats = provider.stats()
        assert stats["evictions"] > 0
        assert stats["expert_bytes_fetched"] == stats["fetches"] * offloaded.expert_nbytes[(0, 0)]
    finally:
        provider.close()


def test_resident_mxfp4_experts_stay_packed(checkpoint):
    form, directory = checkpoint
    stack = load_target(directory).model.experts.stacks[0]
    packed = form == "mxfp4"
    assert (stack["gate_up"].dtype == torch.uint8) == packed and ("down_scales" in stack) == packed


def test_bfloat16_compute_offloaded_equals_resident(checkpoint):
    _, directory = checkpoint
    resident = load_target(directory, dtype="bfloat16").model
    offloaded = load_offloaded_target(directory, dtype="bfloat16", expert_cache_fraction=0.1).model
    with offloaded.experts:
        prompt = torch.tensor(PROMPT)
        expected = resident.forward([prompt], [resident.new_cache()]).logits
        assert torch.equal(offloaded.forward([prompt], [offloaded.new_cache()]).logits, expected)
