"""Ragged batches, cache rollback, the expert byte map and loading errors of the target."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdflash.errors import CheckpointError, ContextLimitError
from pdflash.sampling import SamplingParams
from pdflash.target.attention import SHORT_BLOCK, attend
from pdflash.target.checkpoint import Checkpoint, expert_byte_map
from pdflash.target.config import ModelConfig
from pdflash.target.generate import generate_autoregressive
from pdflash.target.loader import load_target
from pdflash.target.tiny import write_tiny_target


@pytest.fixture(scope="module")
def model(tiny_target):
    return load_target(tiny_target).model


@pytest.mark.parametrize("queries", [1, 8, SHORT_BLOCK + 1])
@pytest.mark.parametrize("masked", [False, True])
def test_attend_matches_sdpa_with_grouped_heads(queries, masked):
    g = torch.Generator().manual_seed(queries)
    q, k, v = (
        torch.randn(shape, generator=g) for shape in ((8, queries, 16), (2, 40 + queries, 16), (2, 40 + queries, 16))
    )
    visible = torch.rand((queries, 40 + queries), generator=g) < 0.7 if masked else None
    if masked:
        visible[:, -1] = True  # every query sees at least one key
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
    torch.testing.assert_close(attend(q, k, v, visible), expected, atol=1e-5, rtol=1e-5)


def test_ragged_batch_equals_each_sequence_alone(model):
    seqs = [torch.randint(0, 260, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 17, 1)]
    alone = [model.forward([s], [model.new_cache()]).logits for s in seqs]
    batch = model.forward(seqs, [model.new_cache() for _ in seqs])
    for got, expected in zip(batch.split(batch.logits), alone):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_ragged_batch_with_different_cache_lengths(model):
    prompts = [torch.arange(10, 10 + n) for n in (3, 9, 6)]
    caches = [model.new_cache() for _ in prompts]
    model.forward(prompts, caches)
    steps = [torch.tensor([7, 8]), torch.tensor([1]), torch.tensor([4, 5, 6])]
    batch = model.forward(steps, caches)
    for prompt, step, got in zip(prompts, steps, batch.split(batch.logits)):
        full = model.forward([torch.cat([prompt, step])], [model.new_cache()]).logits[-step.numel() :]
        torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)


def test_crop_then_recompute_equals_never_computing_past_crop(model):
    cache = model.new_cache()
    model.forward([torch.arange(20, 40)], [cache])
    cache.crop(12)
    resumed = model.forward([torch.tensor([99, 100])], [cache]).logits
    fresh = model.forward([torch.cat([torch.arange(20, 32), torch.tensor([99, 100])])], [model.new_cache()]).logits
    torch.testing.assert_close(resumed, fresh[-2:], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="crop length 30 must be in 0..14"):
        cache.crop(30)


def test_uncommitted_forward_leaves_cache_length(model):
    cache = model.new_cache()
    model.forward([torch.arange(5)], [cache])
    model.forward([torch.arange(3)], [cache], commit=False)
    assert cache.length == 5


def test_routed_ids_are_top_k_of_router(model):
    out = model.forward([torch.arange(6)], [model.new_cache()])
    cfg = model.config
    assert out.routed.shape == (6, len(cfg.moe_layer_ids), cfg.top_k)
    assert int(out.routed.min()) >= 0 and int(out.routed.max()) < cfg.num_experts


def test_byte_map_is_sum_of_numel_times_element_size(tiny_target):
    config = ModelConfig.from_file(tiny_target / "config.json")
    checkpoint = Checkpoint(tiny_target)
    tensors = load_file(tiny_target / "model.safetensors")
    byte_map = expert_byte_map(checkpoint, config)
    assert len(byte_map) == len(config.moe_layer_ids) * config.num_experts
    for (layer, expert), nbytes in byte_map.items():
        prefix = f"model.layers.{layer}.mlp.experts.{expert}."
        expected = sum(t.numel() * t.element_size() for n, t in tensors.items() if n.startswith(prefix))
        assert nbytes == expected


def test_sharded_checkpoint_loads_the_same(tiny_target, tmp_path, model):
    tensors = load_file(tiny_target / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / shard))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_target / name, tmp_path / name)
    sharded = load_target(tmp_path).model
    ids = torch.arange(8)
    torch.testing.assert_close(
        sharded.forward([ids], [sharded.new_cache()]).logits, model.forward([ids], [model.new_cache()]).logits
    )


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_config_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="missing config.json"):
        load_target(tmp_path)


def test_missing_weights_are_named(tiny_target, tmp_path):
    d = _copy(tiny_target, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors and no model.safetensors.index.json"):
        load_target(d)


def test_unsupported_model_type_is_named(tiny_target, tmp_path):
    d = _copy(tiny_target, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text()) | {"model_type": "llama"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported model_type 'llama'; supported: qwen3_moe"):
        load_target(d)


def test_unsupported_rope_type_is_named(tiny_target, tmp_path):
    d = _copy(tiny_target, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text()) | {"rope_scaling": {"rope_type": "longrope"}}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported rope type 'longrope'"):
        load_target(d)


def test_missing_tensor_is_named(tiny_target, tmp_path):
    d = _copy(tiny_target, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.gate.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tensor 'model.layers.1.mlp.gate.weight' is missing"):
        load_target(d)


def test_misshaped_tensor_is_named(tiny_target, tmp_path):
    d = _copy(tiny_target, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has shape \[7\] but the config implies \[64\]"):
        load_target(d)


def test_corrupt_header_is_named(tiny_target, tmp_path):
    d = _copy(tiny_target, tmp_path / "m")
    raw = bytearray((d / "model.safetensors").read_bytes())
    raw[8:20] = b"not json!!!!"
    (d / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"model.safetensors: corrupt safetensors header"):
        load_target(d)


def test_nan_tensor_is_named(tiny_target, tmp_path):
    d = _copy(tiny_target, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight"][0, 0] = float("nan")
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="q_proj.weight' contains NaN"):
        load_target(d)


def test_tokenizer_larger_than_vocab_is_named(tmp_path):
    d = write_tiny_target(tmp_path / "m", vocab_size=200)
    with pytest.raises(CheckpointError, match="tokenizer has 260 tokens but the model's vocab_size is 200"):
        load_target(d)


def test_unknown_dtype_is_named(tiny_target):
    with pytest.raises(ValueError, match="dtype 'fp8' is not supported"):
        load_target(tiny_target, dtype="fp8")


def test_bfloat16_loads_and_runs(tiny_target):
    m = load_target(tiny_target, dtype="bfloat16").model
    assert m.forward([torch.arange(4)], [m.new_cache()]).logits.shape == (4, m.config.vocab_size)


def test_prompt_over_context_limit_is_rejected(tmp_path):
    m = load_target(write_tiny_target(tmp_path / "m", max_position_embeddings=16)).model
    with pytest.raises(ContextLimitError, match="prompt has 16 tokens but the model's context limit is 16"):
        generate_autoregressive(m, list(range(16)), SamplingParams())
    result = generate_autoregressive(m, list(range(10)), SamplingParams(max_tokens=50))
    assert len(result.token_ids) == 6 and result.finish_reason == "length"


def test_chat_template_renders(tiny_target):
    tok = load_target(tiny_target).tokenizer
    text = tok.chat_template.render([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok.encode("def fib(n):")) == "def fib(n):"
