"""Writes small random Qwen3-MoE checkpoints (HF layout, byte-level tokenizer) for tests and first runs.

Random weights generate noise, not text: these checkpoints exercise the engine's real
paths; the trained pair is what shows real acceptance.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TINY_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 260 + len(SPECIAL_TOKENS),
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "float32",
}


def byte_level_tokenizer(special_tokens: tuple[str, ...] = SPECIAL_TOKENS) -> Tokenizer:
    """256 byte tokens (GPT-2 byte-to-unicode alphabet), no merges, plus the special tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(special_tokens))
    return tokenizer


def _attention_tensors(prefix: str, config: dict[str, Any], randn) -> dict[str, torch.Tensor]:
    """Norms and attention projections of one Qwen3 decoder layer (target and drafter share the layout)."""
    H, D = config["hidden_size"], config["head_dim"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    return {
        prefix + "input_layernorm.weight": torch.ones(H),
        prefix + "post_attention_layernorm.weight": torch.ones(H),
        prefix + "self_attn.q_proj.weight": randn(heads * D, H),
        prefix + "self_attn.k_proj.weight": randn(kv * D, H),
        prefix + "self_attn.v_proj.weight": randn(kv * D, H),
        prefix + "self_attn.o_proj.weight": randn(H, heads * D),
        prefix + "self_attn.q_norm.weight": torch.ones(D),
        prefix + "self_attn.k_norm.weight": torch.ones(D),
    }


def random_target_tensors(config: dict[str, Any], generator: torch.Generator, std: float) -> dict[str, torch.Tensor]:
    H = config["hidden_size"]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * std

    tensors = {"model.embed_tokens.weight": randn(config["vocab_size"], H), "model.norm.weight": torch.ones(H)}
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = randn(config["vocab_size"], H)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= _attention_tensors(p, config, randn)
        sparse = i not in config["mlp_only_layers"] and (i + 1) % config["decoder_sparse_step"] == 0
        if sparse:
            inter = config["moe_intermediate_size"]
            tensors[p + "mlp.gate.weight"] = randn(config["num_experts"], H)
            for e in range(config["num_experts"]):
                q = f"{p}mlp.experts.{e}."
                tensors |= {
                    q + "gate_proj.weight": randn(inter, H),
                    q + "up_proj.weight": randn(inter, H),
                    q + "down_proj.weight": randn(H, inter),
                }
        else:
            inter = config["intermediate_size"]
            tensors |= {
                p + "mlp.gate_proj.weight": randn(inter, H),
                p + "mlp.up_proj.weight": randn(inter, H),
                p + "mlp.down_proj.weight": randn(H, inter),
            }
    return tensors


def write_tiny_target(
    directory: Path | str, *, seed: int = 0, std: float = 0.08, with_tokenizer: bool = True, **overrides: Any
) -> Path:
    """A random Qwen3-MoE checkpoint, by default with a byte-level tokenizer and a chat template."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = TINY_CONFIG | overrides
    generator = torch.Generator().manual_seed(seed)
    save_file(random_target_tensors(config, generator, std), str(directory / "model.safetensors"))
    if with_tokenizer:
        tokenizer = byte_level_tokenizer()
        config["eos_token_id"] = tokenizer.token_to_id("<|endoftext|>")
        tokenizer.save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(
            json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|endoftext|>"}, indent=2)
        )
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def drafter_config(
    target_config: dict[str, Any], *, num_layers: int, block_size: int, mask_token_id: int, **overrides: Any
) -> dict[str, Any]:
    """A DFlash drafter config.json (Qwen3 config plus the DFlash fields) paired with `target_config`."""
    heads = target_config["num_attention_heads"]
    return {
        "model_type": "qwen3",
        "architectures": ["DFlashDraftModel"],
        "hidden_size": target_config["hidden_size"],
        "intermediate_size": target_config.get("intermediate_size", 4 * target_config["hidden_size"]),
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": target_config.get("num_key_value_heads", heads),
        "head_dim": target_config.get("head_dim", target_config["hidden_size"] // heads),
        "vocab_size": target_config["vocab_size"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": target_config["max_position_embeddings"],
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": block_size,
        "num_target_layers": target_config["num_hidden_layers"],
        "dflash_config": {"mask_token_id": mask_token_id},
    } | overrides


def random_drafter_tensors(
    config: dict[str, Any], num_taps: int, generator: torch.Generator, std: float
) -> dict[str, torch.Tensor]:
    H, inter = config["hidden_size"], config["intermediate_size"]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * std

    tensors = {"fc.weight": randn(H, num_taps * H), "hidden_norm.weight": torch.ones(H), "norm.weight": torch.ones(H)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        tensors |= _attention_tensors(p, config, randn) | {
            p + "mlp.gate_proj.weight": randn(inter, H),
            p + "mlp.up_proj.weight": randn(inter, H),
            p + "mlp.down_proj.weight": randn(H, inter),
        }
    return tensors


def write_tiny_drafter(
    directory: Path | str,
    target_directory: Path | str,
    *,
    num_layers: int = 2,
    block_size: int = 8,
    seed: int = 1,
    std: float = 0.08,
    **overrides: Any,
) -> Path:
    """A random drafter in the published DFlash layout, paired with the target at `target_directory`."""
    from pdflash.spec.drafter import default_tap_layers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target_config = json.loads((Path(target_directory) / "config.json").read_text())
    mask_id = target_config["vocab_size"] - 1
    tok_path = Path(target_directory) / "tokenizer.json"
    if tok_path.is_file():
        mask_id = Tokenizer.from_file(str(tok_path)).token_to_id("<|mask|>") or mask_id
    config = drafter_config(
        target_config, num_layers=num_layers, block_size=block_size, mask_token_id=mask_id, **overrides
    )
    taps = config["dflash_config"].get("target_layer_ids") or default_tap_layers(
        target_config["num_hidden_layers"], num_layers
    )
    generator = torch.Generator().manual_seed(seed)
    save_file(random_drafter_tensors(config, len(taps), generator, std), str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
