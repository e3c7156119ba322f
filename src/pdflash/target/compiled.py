"""Compiled decode and verify steps behind `Qwen3MoeModel.forward`: buckets, padding, K/V moves, fallback.

Owns choosing a step's bucket (sequences padded up to a batch bucket, each block up to a token
bucket, the past up to a multiple of `KEY_QUANTUM`), gathering the past K/V into the padded
batch and writing the real tokens' K/V back, the compiled callables (one per step function; a
new bucket is a new static specialisation, compiled once and cached: the whole steps by the step
backend, `bind_step`: AOTInductor packages on disk (`aot.py`) or torch.compile), and the eager
fallback for a shape outside every bucket (a logged reason, never an error). The math lives in
`steps.py`; expert weights still come wave by wave from the model's provider.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import torch
from tqdm import tqdm

from pdflash.target import steps
from pdflash.target.aot import AotStep
from pdflash.target.experts import ResidentExperts
from pdflash.target.kv_cache import KVCache, gather_past, store_new

if TYPE_CHECKING:
    from pdflash.target.model import BatchOutput, Qwen3MoeModel

log = logging.getLogger(__name__)

BACKEND_ENV = "PDFLASH_STEP_BACKEND"  # "aot" or "inductor" (step_backend)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
CPP_WRAPPER = True
KEY_QUANTUM = 64  # the padded past is a multiple of this many keys (its length is a dynamic dim)


def bucket_of(value: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= value, None when value is above every bucket."""
    return next((b for b in buckets if b >= value), None)


@attrs.frozen(kw_only=True)
class StepBuckets:
    """The shapes steps are compiled for: sequences per step and new tokens per sequence."""

    batch: tuple[int, ...] = BATCH_BUCKETS
    tokens: tuple[int, ...] = (1,)  # 1 = decode; a drafter's block size = verify

    def __attrs_post_init__(self) -> None:
        for name in ("batch", "tokens"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values) or list(values) != sorted(values):
                raise ValueError(f"{name} buckets must be ascending positive ints, got {values!r}")

    def upto(self, max_batch: int) -> StepBuckets:
        """These buckets cut to the smallest batch bucket holding `max_batch` sequences."""
        top = bucket_of(max_batch, self.batch) or self.batch[-1]
        return attrs.evolve(self, batch=tuple(b for b in self.batch if b <= top))


def transposed(weight: torch.Tensor) -> torch.Tensor:
    """A linear weight [out, in] as the steps take it, [in, out]: a contiguous copy on the CPU,
    where MKL's small-M GEMM streams it about twice as fast from memory (measured cold: 0.31 vs
    0.62 ms for the bundled 4096 x 256 head at one token), a view elsewhere (no copy)."""
    return weight.t().contiguous() if weight.device.type == "cpu" else weight.t()


def compile_step(fn: Callable, device: torch.device) -> Callable:
    """torch.compile (inductor) of one step function; CUDA graphs on CUDA ("reduce-overhead").

    `fn` must be a plain function (bind constants around the result, not inside): dynamo keeps
    one cache per code object, and wrapped partials would share one, chaining every step's guards.
    """
    if device.type == "cuda":
        return torch.compile(fn, fullgraph=True, mode="reduce-overhead")
    return torch.compile(fn, fullgraph=True, options={"cpp_wrapper": CPP_WRAPPER})


def step_backend(device: torch.device) -> str:
    """How whole steps compile: "aot" (AOTInductor packages, the CPU default), "inductor"
    (torch.compile; always on CUDA, where it captures CUDA graphs), or $PDFLASH_STEP_BACKEND."""
    if device.type != "cpu":
        return "inductor"
    backend = os.environ.get(BACKEND_ENV, "aot")
    if backend not in ("aot", "inductor"):
        raise ValueError(f"${BACKEND_ENV} must be 'aot' or 'inductor', got {backend!r}")
    return backend


def bind_step(
    fn: Callable,
    device: torch.device,
    constants: tuple[Any, ...],
    options: dict[str, Any],
    *,
    key_dims: dict[int, int],
    compiled: bool,
) -> Callable[..., Any]:
    """`fn(*inputs, *constants, **options)` as a callable of the inputs alone, compiled by the
    step backend (`compiled=False`: fn itself). `key_dims` maps an input to its key-length
    dimension, which stays dynamic: one compiled form serves every past length."""
    if not compiled:
        return lambda *inputs: fn(*inputs, *constants, **options)
    step = compile_step(fn, device)

    def inductor(*inputs: torch.Tensor) -> Any:
        for index, dim in key_dims.items():
            torch._dynamo.mark_dynamic(inputs[index], dim)
        return step(*inputs, *constants, **options)

    if step_backend(device) == "aot":
        return AotStep(fn, constants, options=options, key_dims=key_dims, min_keys=KEY_QUANTUM, fallback=inductor)
    return inductor


class TargetSteps:
    """Runs the target's forward through the static-shape steps when its shape fits a bucket."""

    def __init__(self, model: Qwen3MoeModel, buckets: StepBuckets, *, compiled: bool = True) -> None:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # a graph per bucket
        self.model, self.buckets, self.compiled = model, buckets, compiled
        cfg = model.config
        wrap = partial(compile_step, device=model.device) if compiled else (lambda fn: fn)
        self._inv_freq = model.rotary.inv_freq.to(model.device)
        consts = {
            "num_heads": cfg.num_heads,
            "eps": cfg.rms_norm_eps,
            "top_k": cfg.top_k,
            "norm_topk": cfg.norm_topk_prob,
        }
        self._inputs = wrap(steps.step_inputs)
        self._attention = partial(wrap(steps.attention_step), **consts)
        self._experts = wrap(steps.gathered_experts)
        self._dense_mlp = wrap(steps.dense_mlp)
        self._head = partial(wrap(steps.head_step), eps=cfg.rms_norm_eps)
        self._layers = tuple(
            (w.input_norm, transposed(w.attention.qkv_proj), w.attention.qkv_bias, transposed(w.attention.o_proj),
             w.attention.o_bias, w.attention.q_norm, w.attention.k_norm, w.post_attention_norm,
             None if w.router is None else transposed(w.router))
            for w in model.layers
        )  # fmt: skip  # attention_step's weights per layer, linear ones transposed
        self._dense = {i: tuple(map(transposed, w.dense)) for i, w in enumerate(model.layers) if w.dense is not None}
        self.lm_head_t = transposed(model.lm_head)  # [H, V] (a drafter sharing the head shares this too)
        self._step = self._bind_whole(consts) if isinstance(model.experts, ResidentExperts) else None
        self.fallbacks: Counter[str] = Counter()  # reason -> eager forwards taken for it
        self.warm_up_s = 0.0

    def shape_of(self, token_ids: Sequence[torch.Tensor], skip: bool = False) -> tuple[int, int] | str:
        """(batch bucket, token bucket) for these blocks, or why none fits."""
        counts = [int(t.numel()) for t in token_ids]
        if skip:
            return "a router-only pass (skip_experts)"
        if not counts or min(counts) < 1:
            return "an empty batch or block"
        batch = bucket_of(len(counts), self.buckets.batch)
        tokens = bucket_of(max(counts), self.buckets.tokens)
        if batch is None:
            return f"more sequences than the largest batch bucket ({self.buckets.batch[-1]})"
        if tokens is None:  # prefill, typically
            return f"a block longer than the largest token bucket ({self.buckets.tokens[-1]} tokens)"
        return batch, tokens

    def fall_back(self, reason: str) -> None:
        """Count an eager forward; log its reason at INFO the first time it is seen."""
        self.fallbacks[reason] += 1
        (log.info if self.fallbacks[reason] == 1 else log.debug)("eager forward: %s", reason)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: Sequence[torch.Tensor],
        caches: Sequence[KVCache],
        shape: tuple[int, int],
        *,
        last_logits_only: bool,
        taps: Sequence[int],
        commit: bool,
    ) -> BatchOutput:
        """The model's forward for blocks that fit `shape` (from `shape_of`), same outputs and cache effects."""
        from pdflash.target.model import BatchOutput

        model, cfg = self.model, self.model.config
        batch, tokens = shape
        counts = [int(t.numel()) for t in token_ids]
        lengths = [c.length for c in caches]
        keys = -(-max(lengths) // KEY_QUANTUM) * KEY_QUANTUM or KEY_QUANTUM  # padded past S
        for cache, n in zip(caches, counts, strict=True):
            cache.reserve(max(keys, cache.length + n))
        full = len(counts) == batch and min(counts) == tokens  # no padded row or token
        views = full and not (model.device.type == "cuda" and self.compiled)  # a CUDA graph reuses its outputs
        if full:
            ids = torch.stack(list(token_ids))  # [B, n]
        else:
            ids = torch.zeros((batch, tokens), dtype=torch.int64)  # [B, n] padded with token 0
            for row, t in enumerate(token_ids):
                ids[row, : counts[row]] = t
        past_k, past_v = gather_past(caches, keys, batch)  # [L, B, kv, S, D] each
        lengths_t = torch.tensor(lengths + [0] * (batch - len(counts)), dtype=torch.int64)
        every = None if views else _real_rows(counts, tokens, last_only=False).to(model.device)  # [T_real] real rows
        if model.device.type == "cuda" and self.compiled:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs may be reused
        run = self._whole if self._step is not None else self._layered
        logits, new_k, new_v, outputs, routed = run(
            ids.to(model.device), lengths_t.to(model.device), past_k, past_v, every
        )
        store_new(caches, counts, new_k, new_v, commit=commit)
        logits = logits.view(batch * tokens, -1)  # [B*n, V]
        flat = outputs.view(len(model.layers), batch * tokens, cfg.hidden_size)  # [L, B*n, H]
        if views:  # outputs returned as views of the step's, not index copies
            last = logits.view(batch, tokens, -1)[:, -1] if last_logits_only else logits  # [N, V] or [T, V]
            return BatchOutput(
                seq_lens=tuple(counts),
                logit_lens=tuple([1] * len(counts) if last_logits_only else counts),
                logits=last,
                taps=torch.cat([flat[t] for t in taps], dim=-1) if taps else None,
                routed=routed,
            )
        assert every is not None  # set whenever outputs are copied
        rows = _real_rows(counts, tokens, last_only=last_logits_only).to(model.device)
        return BatchOutput(
            seq_lens=tuple(counts),
            logit_lens=tuple([1] * len(counts) if last_logits_only else counts),
            logits=logits[rows],
            taps=torch.cat([flat[t, every] for t in taps], dim=-1) if taps else None,
            routed=routed[every],
        )

    def _mark(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Compile `tensor`'s `dim` (a key length) as a dynamic size: one graph serves every length."""
        if self.compiled:
            torch._dynamo.mark_dynamic(tensor, dim)
        return tensor

    def _bind_whole(self, consts: dict[str, Any]) -> Callable[..., Any]:
        """whole_step over the model's weights, a callable of (ids, lengths, past_k, past_v)."""
        model = self.model
        stacks = model.experts.stacks  # type: ignore[attr-defined]  # a ResidentExperts
        mlps = tuple(stacks[i] if w.router is not None else self._dense[i] for i, w in enumerate(model.layers))
        weights = (model.embed, self._inv_freq, self._layers, mlps, model.final_norm, self.lm_head_t)
        options = {"rope_scale": model.rotary.scale, **consts}
        return bind_step(
            steps.whole_step, model.device, weights, options, key_dims={2: 3, 3: 3}, compiled=self.compiled
        )

    def _whole(self, ids, lengths, past_k, past_v, every) -> tuple[torch.Tensor, ...]:
        """All layers in one compiled call (every expert resident)."""
        assert self._step is not None  # bound at install when the experts are resident
        return self._step(ids, lengths, past_k, past_v)

    def _layered(self, ids, lengths, past_k, past_v, every) -> tuple[torch.Tensor, ...]:
        """A compiled call per layer part, expert waves from the provider in between (offloaded experts)."""
        model, cfg = self.model, self.model.config
        x, cos, sin, visible = self._inputs(ids, lengths, past_k, model.embed, self._inv_freq, model.rotary.scale)
        self._mark(visible, 2)
        layer_k = [self._mark(t, 2) for t in past_k.unbind(0)]  # [B, kv, S, D] per layer
        layer_v = [self._mark(t, 2) for t in past_v.unbind(0)]
        mlp_out = torch.zeros((ids.numel(), cfg.hidden_size), dtype=torch.float32, device=ids.device)
        new_k, new_v, outputs, routed = [], [], [], []
        for layer, w in enumerate(model.layers):
            outs = self._attention(x, mlp_out, cos, sin, visible, layer_k[layer], layer_v[layer], *self._layers[layer])
            entering, x, h, k, v = outs[:5]
            outputs += [entering] if layer else []
            new_k.append(k)
            new_v.append(v)
            if w.router is None:
                mlp_out = self._dense_mlp(h, *self._dense[layer])
                continue
            topk_ids, topk_weights = outs[5:]
            routed.append(topk_ids)
            union = topk_ids if every is None else topk_ids[every]  # padded rows fetch nothing
            parts = [
                self._experts(h, topk_ids, topk_weights, wave.slot_of_expert, wave.gate, wave.up, wave.down)
                for wave in model.experts.waves(layer, union.unique().tolist())
            ]
            mlp_out = torch.stack(parts).sum(0) if len(parts) > 1 else parts[0]
        x, logits = self._head(x, mlp_out, model.final_norm, self.lm_head_t)
        routed_ids = torch.stack(routed, dim=1) if routed else steps.topk_ids_none(ids.numel(), cfg.top_k, x.device)
        return logits, torch.stack(new_k), torch.stack(new_v), torch.stack(outputs + [x]), routed_ids

    def warm_up(self, caches_factory: Callable[[], KVCache], *, progress: bool = False) -> float:
        """Run every bucket once (compiling it when compiled) over scratch caches; seconds spent."""
        started = time.perf_counter()
        shapes = [(b, n) for n in self.buckets.tokens for b in self.buckets.batch]
        for batch, tokens in tqdm(shapes, desc="compiling steps", disable=not progress):
            caches = [caches_factory() for _ in range(batch)]
            blocks = [torch.ones(tokens, dtype=torch.int64) for _ in range(batch)]
            self.forward(blocks, caches, (batch, tokens), last_logits_only=False, taps=(), commit=False)
        self.warm_up_s = time.perf_counter() - started
        return self.warm_up_s

    def stats(self) -> dict[str, Any]:
        return {"compiled": self.compiled, "warm_up_s": self.warm_up_s, "eager_fallbacks": dict(self.fallbacks)}


def _real_rows(counts: Iterable[int], tokens: int, *, last_only: bool) -> torch.Tensor:
    """Flat [B*n] row indices of real tokens (each sequence's last when `last_only`), in batch order."""
    rows = [
        b * tokens + (n - 1 if last_only else j) for b, n in enumerate(counts) for j in range(1 if last_only else n)
    ]
    return torch.tensor(rows, dtype=torch.int64)
