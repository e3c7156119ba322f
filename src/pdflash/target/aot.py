"""AOTInductor steps on the CPU: a step function exported once per shape, packaged on disk, run without dynamo.

Owns `AotStep`: `fn(*inputs, *constants, **options)` as a callable of the inputs alone. Per input
shape (a key length dimension stays dynamic) and thread count it exports the function
(`torch.export`), compiles it into an AOTInductor package (`aoti_compile_and_package`) kept in a
cache directory, and loads it with the constants (the weights) pointed to, not copied
(`load_constants(user_managed=True)`; the package holds no weights). A call is then one C++
run: no dynamo guards over ~50 tensors, no Python wrapper (docs/compile.md measures both).
Packages are keyed by the step's source, every shape, dtype and stride, the options, the thread
count, inductor's settings, the CPU's vector ISA and the torch version, so a changed model, code
or setting builds a new one. A shape whose package cannot be built or loaded runs `fallback`
(torch.compile) with a logged reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import os
import sys
import tempfile
import time
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

log = logging.getLogger(__name__)

CACHE_ENV = "PDFLASH_AOT_CACHE"  # where packages are kept (default: $XDG_CACHE_HOME/pdflash/aot)
_FORMAT = 1  # bump when what a package is keyed by changes


def cache_dir() -> Path:
    """The package directory: $PDFLASH_AOT_CACHE, else $XDG_CACHE_HOME (or ~/.cache) /pdflash/aot."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdflash" / "aot"


class _Bound(torch.nn.Module):
    """The step with its constants as buffers (what is exported): forward(inputs) = fn(*inputs, *constants)."""

    def __init__(self, fn: Callable, constants: tuple[Any, ...], options: Mapping[str, Any]) -> None:
        super().__init__()
        leaves, self._spec = pytree.tree_flatten(constants)
        self.fn, self.options = fn, dict(options)
        self._leaves: list[str | None] = []  # a buffer's name per leaf; None for a None leaf (no bias)
        for i, leaf in enumerate(leaves):
            self._leaves.append(None if leaf is None else f"c{i}")
            if leaf is not None:
                self.register_buffer(f"c{i}", leaf, persistent=False)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> Any:
        leaves = [None if name is None else getattr(self, name) for name in self._leaves]
        return self.fn(*inputs, *pytree.tree_unflatten(leaves, self._spec), **self.options)


class AotStep:
    """`fn(*inputs, *constants, **options)` run from AOTInductor packages, one per input shape."""

    def __init__(
        self,
        fn: Callable,
        constants: tuple[Any, ...],
        *,
        options: Mapping[str, Any],
        key_dims: Mapping[int, int],  # input index -> its dimension that is a key length (dynamic)
        min_keys: int,  # the shortest key length a call passes (the padded past's quantum)
        fallback: Callable[..., Any],  # runs the same inputs when a package cannot be had
    ) -> None:
        self.bound = _Bound(fn, constants, options)
        self.key_dims, self.min_keys, self.fallback = dict(key_dims), min_keys, fallback
        self._runners: dict[tuple, Callable[[list[torch.Tensor]], Any]] = {}  # by shape, key lengths as -1
        self._seen: dict[tuple, Callable[[list[torch.Tensor]], Any]] = {}  # by exact shapes and strides
        self.built_s = 0.0  # seconds spent exporting and compiling packages (0 when all came from disk)
        self._digest = _source_digest(fn)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        seen = (torch.get_num_threads(), *((t.shape, t.stride()) for t in inputs))  # cheaper than _shape
        runner = self._seen.get(seen)
        if runner is None:  # a new key length, or a new shape
            shape = self._shape(inputs)
            if shape not in self._runners:
                self._runners[shape] = self._runner(self.package_path(inputs), inputs)
            runner = self._seen[seen] = self._runners[shape]
        return runner(list(inputs))

    def package_path(self, inputs: Sequence[torch.Tensor]) -> Path:
        """Where the package for these inputs (and the current thread count) is kept."""
        return cache_dir() / f"{self.bound.fn.__name__}-{self._key(self._shape(inputs))}.pt2"

    def _shape(self, inputs: Sequence[torch.Tensor]) -> tuple:
        return (torch.get_num_threads(), *(self._signature(i, t) for i, t in enumerate(inputs)))

    def _signature(self, index: int, tensor: torch.Tensor) -> tuple:
        """(shape, stride, dtype) with the key dimension as -1 (one package serves every length)."""
        dim = self.key_dims.get(index)
        sizes = tuple(-1 if d == dim else s for d, s in enumerate(tensor.shape))
        strides = tuple(tensor.stride()) if dim is None else ()  # a key dim's strides follow its size
        return sizes, strides, str(tensor.dtype)

    def _runner(self, path: Path, inputs: Sequence[torch.Tensor]) -> Callable[[list[torch.Tensor]], Any]:
        try:
            if not path.exists():
                self._build(path, inputs)
            package = torch._inductor.aoti_load_package(str(path))
            buffers = dict(self.bound.named_buffers())
            package.load_constants(
                {n: buffers[n] for n in package.get_constant_fqns()}, check_full_update=True, user_managed=True
            )
        except Exception as error:  # any failure to build or load means the other backend
            log.warning("AOTInductor step %s unavailable (%s); using torch.compile", path.name, error)
            return lambda flat: self.fallback(*flat)
        loader, out_spec = package.loader, pytree.treespec_loads(package.loader.get_call_spec()[1])
        if out_spec.type is tuple and all(child.is_leaf() for child in out_spec.children()):
            return lambda flat: tuple(loader.run(flat))  # a step's outputs: a flat tuple of tensors
        return lambda flat: pytree.tree_unflatten(loader.run(flat), out_spec)

    def _build(self, path: Path, inputs: Sequence[torch.Tensor]) -> None:
        """Export the step for these inputs' shapes (key lengths dynamic) and package it at `path`."""
        started = time.perf_counter()
        keys = torch.export.Dim("keys", min=self.min_keys)
        dynamic = [{self.key_dims[i]: keys} if i in self.key_dims else None for i in range(len(inputs))]
        with torch.inference_mode(False), torch.no_grad():
            program = torch.export.export(self.bound, (tuple(inputs),), dynamic_shapes=(tuple(dynamic),), strict=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(suffix=".pt2", dir=path.parent)
        os.close(fd)
        try:
            torch._inductor.aoti_compile_and_package(
                program, package_path=scratch, inductor_configs={"aot_inductor.package_constants_in_so": False}
            )
            os.replace(scratch, path)  # whole packages only, even with another process building the same
        finally:
            Path(scratch).unlink(missing_ok=True)
        self.built_s += time.perf_counter() - started
        log.info("built AOTInductor step %s in %.1f s", path.name, time.perf_counter() - started)

    def _key(self, shape: tuple) -> str:
        """A digest of everything the package depends on besides the constants' values."""
        constants = [(tuple(b.shape), tuple(b.stride()), str(b.dtype)) for b in self.bound.buffers()]
        cpu = torch.backends.cpu.get_cpu_capability()
        options = sorted(self.bound.options.items())
        inductor = sorted(  # e.g. kernel profiling; the metadata a first package build fills in is not a setting
            (k, v) for k, v in torch._inductor.config.save_config_portable().items() if k != "aot_inductor.metadata"
        )
        parts = (_FORMAT, torch.__version__, cpu, self._digest, shape, self.min_keys, constants, options, inductor)
        return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def _source_digest(fn: Callable) -> str:
    """The source of `fn`'s module and of the pdflash modules its globals come from (what it computes)."""
    names = {fn.__module__}
    for value in fn.__globals__.values():
        module = value if isinstance(value, types.ModuleType) else sys.modules.get(getattr(value, "__module__", ""))
        if module is not None and module.__name__.startswith("pdflash."):
            names.add(module.__name__)
    digest = hashlib.sha256(fn.__qualname__.encode() + fn.__code__.co_code)  # even when a module has no source
    for name in sorted(names):
        with contextlib.suppress(OSError, TypeError):
            digest.update(inspect.getsource(sys.modules[name]).encode())
    return digest.hexdigest()
