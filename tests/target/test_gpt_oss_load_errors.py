"""A broken gpt-oss checkpoint fails at load with a message naming the tensor (or field) at fault."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdflash.errors import CheckpointError
from pdflash.offload import load_offloaded_target
from pdflash.target.loader import load_target
from pdflash.target.tiny_gpt_oss import write_tiny_gpt_oss

SCALES = "model.layers.1.mlp.experts.down_proj_scales"
BLOCKS = "model.layers.2.mlp.experts.gate_up_proj_blocks"


@pytest.fixture
def directory(tmp_path):
    return write_tiny_gpt_oss(tmp_path / "g", with_tokenizer=False)


def rewrite(directory, change):
    tensors = load_file(directory / "model.safetensors")
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"))


@pytest.mark.parametrize("loader", [load_target, lambda d: load_offloaded_target(d, expert_cache_fraction=0.5)])
def test_missing_scales_are_named(directory, loader):
    rewrite(directory, lambda t: t.pop(SCALES))
    with pytest.raises(CheckpointError, match=f"tensor '{SCALES}' is missing"):
        loader(directory)


def test_wrong_block_shape_is_named_with_the_shape_expected(directory):
    def cut(tensors):
        tensors[BLOCKS] = tensors[BLOCKS][..., :8].contiguous()  # 16 bytes per block of 32 values

    rewrite(directory, cut)
    with pytest.raises(
        CheckpointError, match=rf"tensor '{BLOCKS}' has shape \[8, 64, 2, 8\].*implies \[8, 64, 2, 16\]"
    ):
        load_target(directory)


def test_blocks_of_the_wrong_dtype_are_named(directory):
    rewrite(directory, lambda t: t.__setitem__(BLOCKS, t[BLOCKS].to(torch.int16)))
    with pytest.raises(CheckpointError, match=f"tensor '{BLOCKS}' must be uint8"):
        load_target(directory)


def test_unknown_quantization_method_is_named(directory):
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "awq"
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quant_method 'awq' is not supported for gpt_oss; supported: mxfp4"):
        load_target(directory)


def test_dequantized_checkpoint_missing_an_expert_tensor_is_named(tmp_path):
    directory = write_tiny_gpt_oss(tmp_path / "d", mxfp4=False, with_tokenizer=False)
    rewrite(directory, lambda t: t.pop("model.layers.0.mlp.experts.down_proj_bias"))
    with pytest.raises(CheckpointError, match="tensor 'model.layers.0.mlp.experts.down_proj_bias' is missing"):
        load_target(directory)


def test_sliding_layers_without_a_window_are_rejected(directory):
    config = json.loads((directory / "config.json").read_text()) | {"sliding_window": None}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="sliding_attention layers need sliding_window >= 1; got None"):
        load_target(directory)


def test_nan_scale_is_named_at_load_and_at_first_fetch(directory):
    def poison(tensors):
        tensors[SCALES][3, 0, 0] = 255  # E8M0's NaN

    rewrite(directory, poison)
    with pytest.raises(CheckpointError, match=f"tensor '{SCALES}' holds the E8M0 scale 255"):
        load_target(directory)
    with load_offloaded_target(directory, expert_cache_fraction=0.5).model.experts as provider:
        provider.store.expert((1, 2))  # an expert whose scales are fine
        with pytest.raises(CheckpointError, match=f"tensor '{SCALES}' holds the E8M0 scale 255"):
            provider.store.expert((1, 3))
