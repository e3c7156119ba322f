"""gpt-oss configs as published parse to the right model, and give their byte maps from the config alone."""

import pytest

from pdflash.errors import CheckpointError
from pdflash.target.config import model_config_from_dict
from pdflash.target.gpt_oss_config import GptOssConfig
from pdflash.target.gpt_oss_layout import config_byte_map


def published(num_layers: int, num_experts: int) -> dict:
    """The fields of openai/gpt-oss-20b and -120b's config.json (hub layout: rope_theta + rope_scaling)."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "attention_bias": True,
        "eos_token_id": 200002,
        "pad_token_id": 199999,
        "head_dim": 64,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "initial_context_length": 4096,
        "layer_types": ["sliding_attention", "full_attention"] * (num_layers // 2),
        "max_position_embeddings": 131072,
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": 8,
        "num_local_experts": num_experts,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "vocab_size": 201088,
    }


@pytest.mark.parametrize("layers, experts", [(24, 32), (36, 128)], ids=["gpt-oss-20b", "gpt-oss-120b"])
def test_published_config_parses_and_sizes_its_experts(layers, experts):
    config = model_config_from_dict(published(layers, experts))
    assert isinstance(config, GptOssConfig) and config.quant_method == "mxfp4"
    assert config.layer_windows[:2] == (128, None) and len(config.layer_windows) == layers
    assert (config.rope.rope_type, config.rope.factor, config.rope.theta, config.rope.truncate) == (
        "yarn",
        32.0,
        150000.0,
        False,
    )
    assert (config.top_k, config.num_kv_heads, config.eos_token_ids) == (4, 8, (200002,))
    byte_map = config_byte_map(config)
    # one expert: gate_up 5760 x 2880 and down 2880 x 2880 at 4 bits + one E8M0 byte per 32 + bf16 biases
    per_expert = (5760 * 2880 + 2880 * 2880) // 2 + (5760 * 2880 + 2880 * 2880) // 32 + 2 * (5760 + 2880)
    assert per_expert == 13_236_480
    assert len(byte_map) == layers * experts and set(byte_map.values()) == {per_expert}


def test_unknown_layer_type_is_named():
    raw = published(24, 32) | {"layer_types": ["sliding_attention", "chunked_attention"] * 12}
    with pytest.raises(CheckpointError, match="layer_types must list 24 entries of sliding_attention, full_attention"):
        model_config_from_dict(raw)


def test_top_k_beyond_the_experts_is_named():
    with pytest.raises(CheckpointError, match="num_experts_per_tok=40 must be in 1..num_local_experts=32"):
        model_config_from_dict(published(24, 32) | {"num_experts_per_tok": 40})
