"""Local Hugging Face checkpoint files: safetensors headers, tensor loading, the expert byte map.

Owns file discovery (single or sharded safetensors), the one parse of every file's header
(an 8-byte little-endian length, then JSON with dtype, shape and data_offsets per tensor)
and validation of what is on disk; knows nothing of model math. The host expert store maps
tensors straight from the byte ranges recorded here.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import attrs
import torch
from safetensors import SafetensorError, safe_open

from pdflash.errors import CheckpointError
from pdflash.target.config import ModelConfig
from pdflash.target.experts import ExpertKey

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@attrs.frozen
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int  # first byte of its data in `file`
    end: int  # one past its last byte

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize


class Checkpoint:
    """The tensors of one checkpoint directory, by name, read lazily from their files."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: checkpoint directory does not exist")
        self.tensors: dict[str, TensorInfo] = {}
        for file in self._files():
            for name, info in _read_header(file).items():
                self.tensors[name] = info

    def _files(self) -> list[Path]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({exc})") from exc
            files = sorted({self.directory / shard for shard in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index}: lists shard files that are missing: {', '.join(missing)}")
            return files
        single = self.directory / SINGLE_FILE
        if single.is_file():
            return [single]
        raise CheckpointError(
            f"{self.directory}: no {SINGLE_FILE} and no {INDEX_FILE} (expected Hugging Face safetensors weights)"
        )

    def info(self, name: str, shape: tuple[int, ...]) -> TensorInfo:
        """The header of `name`, checked to exist with the shape the config implies."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.directory}: tensor {name!r} is missing from the checkpoint")
        if info.shape != tuple(shape):
            raise CheckpointError(
                f"{info.file}: tensor {name!r} has shape {list(info.shape)} but the config implies {list(shape)}"
            )
        return info

    def load(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        info = self.info(name, shape)
        try:
            with safe_open(info.file, framework="pt") as handle:
                tensor = handle.get_tensor(name)
        except SafetensorError as exc:
            raise CheckpointError(f"{info.file}: cannot read tensor {name!r} ({exc})") from exc
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(f"{info.file}: tensor {name!r} contains NaN or infinite values")
        return tensor.to(dtype)


def _read_header(file: Path) -> dict[str, TensorInfo]:
    try:
        with open(file, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(header_len))
        size = file.stat().st_size
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: corrupt safetensors header ({exc})") from exc
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (not a JSON object)")
    data_start = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _dtype(file, name, entry["dtype"])
            shape = tuple(int(d) for d in entry["shape"])
            start, end = (data_start + int(offset) for offset in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{file}: corrupt safetensors header entry for {name!r} ({exc!r})") from exc
        info = TensorInfo(file, shape, dtype, start, end)
        if end - start != info.nbytes or end > size:
            raise CheckpointError(
                f"{file}: tensor {name!r} spans bytes [{start}, {end}) of a {size}-byte file, "
                f"but {dtype} {list(shape)} needs {info.nbytes} bytes inside it"
            )
        tensors[name] = info
    return tensors


def _dtype(file: Path, name: str, code: str) -> torch.dtype:
    if code not in _DTYPES:
        raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {code}")
    return _DTYPES[code]


def expert_tensor_name(layer: int, expert: int, projection: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"


def expert_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    inter, hidden = config.moe_intermediate_size, config.hidden_size
    return {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def expert_byte_map(checkpoint: Checkpoint, config: ModelConfig) -> dict[ExpertKey, int]:
    """expert_nbytes[(layer, expert)]: exact payload bytes of that expert as stored (all its tensors)."""
    shapes = expert_shapes(config)
    return {
        (layer, expert): sum(
            checkpoint.info(expert_tensor_name(layer, expert, proj), shape).nbytes for proj, shape in shapes.items()
        )
        for layer in config.moe_layer_ids
        for expert in range(config.num_experts)
    }
