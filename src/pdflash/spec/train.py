"""Trains a DFlash drafter against a frozen target (the DFlash recipe, DFLASH.md "Training a drafter").

Owns the training data (target-generated continuations and their tap hidden states), the
block-masked training forward, the position-weighted loss and the optimiser loop. It writes
checkpoints in the published DFlash layout, so `load_drafter` and other engines read them
unchanged. The target stays frozen; its embedding and LM head are shared, never trained.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from pdflash.sampling import SamplingParams
from pdflash.spec.drafter import DrafterConfig, default_tap_layers
from pdflash.spec.speculator import Speculator
from pdflash.target.loader import LoadedTarget
from pdflash.target.model import rms_norm, swiglu
from pdflash.target.rope import Rotary, apply_rotary
from pdflash.target.tiny import drafter_config, random_drafter_tensors

DECAY_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}  # γ of the position weights exp(-(k-1)/γ)


@attrs.frozen(kw_only=True)
class TrainSettings:
    num_layers: int = 1
    block_size: int = 8
    steps: int = 1000
    minutes: float | None = None  # wall-time budget: the schedule follows whichever budget runs out first
    batch_sequences: int = 8  # sequences per step
    anchors_per_sequence: int = 8  # blocks per sequence per step
    lr: float = 6e-4
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    init_std: float = 0.02
    tap_layers: tuple[int, ...] | None = attrs.field(default=None, converter=lambda t: None if t is None else tuple(t))
    # target layers feeding `fc`; None spreads them as published drafters do (default_tap_layers)

    def __attrs_post_init__(self) -> None:
        for name in ("num_layers", "steps", "batch_sequences", "anchors_per_sequence"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.minutes is not None and self.minutes <= 0:
            raise ValueError(f"minutes must be > 0, got {self.minutes}")

    @property
    def decay(self) -> float:
        return DECAY_BY_BLOCK.get(self.block_size, self.block_size / 2)


@attrs.frozen(kw_only=True)
class TrainingData:
    token_ids: torch.Tensor  # [S, L] prompt + response, all sequences the same length
    taps: torch.Tensor  # [S, L, n_taps*H] the target's residual stream at the tap layers (float16 storage)
    prompt_len: int  # anchors are drawn from positions prompt_len … L-block_size


@attrs.frozen(kw_only=True)
class TrainResult:
    losses: tuple[float, ...]  # per step
    steps: int
    seconds: float


def build_training_data(
    target: LoadedTarget,
    prompts: Sequence[Sequence[int]],
    *,
    response_tokens: int,
    tap_layers: Sequence[int],
    generate: bool = True,
    batch: int = 128,
    progress: bool = False,
) -> TrainingData:
    """Prompt + the target's own greedy continuation (or the given text) and its tap states.

    With `generate=False` each prompt must already hold prompt + response tokens.
    """
    model = target.model
    prompt_len = min(len(p) for p in prompts) - (0 if generate else response_tokens)
    if prompt_len < 1:
        raise ValueError(f"prompts must hold at least {1 + (0 if generate else response_tokens)} tokens")
    rows = [list(p[: prompt_len + (0 if generate else response_tokens)]) for p in prompts]
    if generate:
        spec = Speculator(model, None, expert_nbytes=target.expert_nbytes, projector="last-union")
        params = SamplingParams(max_tokens=response_tokens, stop_token_ids=())
        for start in tqdm(range(0, len(rows), batch), desc="target continuations", disable=not progress):
            sessions = spec.begin_sessions([(r, params) for r in rows[start : start + batch]])
            while live := [s for s in sessions if not s.finished]:
                spec.draft_rounds(live)
                spec.verify_rounds(live)
            for row, session in zip(rows[start : start + batch], sessions):
                row += session.emitted  # shorter than response_tokens if the target stopped early
                spec.release(session)
        rows = [r for r in rows if len(r) == prompt_len + response_tokens]
        if not rows:
            raise ValueError(f"every continuation stopped before {response_tokens} tokens; use fewer response tokens")
    token_ids = torch.tensor(rows, dtype=torch.int64)  # [S, L]
    taps = []
    for start in tqdm(range(0, len(rows), batch), desc="target taps", disable=not progress):
        chunk = list(token_ids[start : start + batch])
        out = model.forward(chunk, [model.new_cache() for _ in chunk], last_logits_only=True, taps=tuple(tap_layers))
        assert out.taps is not None  # asked for above
        states = out.taps.float().view(len(chunk), token_ids.shape[1], -1)
        if not torch.isfinite(states.half()).all():
            raise ValueError("target tap states overflow float16 storage")
        taps.append(states.half())  # half the memory: tap states of thousands of sequences add up
    return TrainingData(token_ids=token_ids, taps=torch.cat(taps), prompt_len=prompt_len)


def cached_training_data(path: Path | str | None, key: dict, build: Callable[[], TrainingData]) -> TrainingData:
    """`build()`, memoised in `path` under `key` (everything the data depends on); a stale file is rebuilt."""
    if path is None:
        return build()
    path = Path(path)
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        if saved["key"] == json.dumps(key, sort_keys=True):
            return TrainingData(token_ids=saved["token_ids"], taps=saved["taps"], prompt_len=int(saved["prompt_len"]))
    data = build()
    tmp = path.with_name(path.name + ".tmp")
    torch.save(
        {
            "key": json.dumps(key, sort_keys=True),
            "token_ids": data.token_ids,
            "taps": data.taps,
            "prompt_len": data.prompt_len,
        },
        tmp,
    )
    tmp.replace(path)
    return data


class DrafterTrainer:
    """Trainable drafter weights, keyed by their DFlash checkpoint names, and the training forward."""

    def __init__(self, target: LoadedTarget, settings: TrainSettings) -> None:
        tcfg = target.model.config
        self.target, self.settings = target, settings
        tokenizer = target.tokenizer
        mask_id = (tokenizer.token_id("<|mask|>") if tokenizer else None) or tcfg.vocab_size - 1
        raw_target = json.loads((target.checkpoint.directory / "config.json").read_text())
        self.raw_config = drafter_config(
            raw_target | {"num_hidden_layers": tcfg.num_layers, "vocab_size": tcfg.vocab_size},
            num_layers=settings.num_layers,
            block_size=settings.block_size,
            mask_token_id=mask_id,
        )
        taps = settings.tap_layers or default_tap_layers(tcfg.num_layers, settings.num_layers)
        self.raw_config["dflash_config"]["target_layer_ids"] = list(taps)
        self.config = DrafterConfig.from_dict(self.raw_config, "trainer")
        generator = torch.Generator().manual_seed(settings.seed)
        init = random_drafter_tensors(self.raw_config, len(self.config.tap_layers), generator, settings.init_std)
        self.weights = {name: torch.nn.Parameter(t) for name, t in init.items()}
        self.rotary = Rotary(self.config.rope, self.config.head_dim)
        self.embed = target.model.embed.float()  # [V, H] frozen
        self.lm_head = target.model.lm_head.float()  # [V, H] frozen

    def block_logits(self, token_ids: torch.Tensor, taps: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """token_ids [N, L], taps [N, L, n_taps*H], anchors [N, K] → [N, K, B-1, V] draft logits.

        Each block [token@anchor, MASK×(B−1)] sits at anchor … anchor+B−1, attends to context
        strictly before its anchor and to its own block (bidirectionally), never to other blocks.
        """
        cfg, w, B = self.config, self.weights, self.settings.block_size
        N, L = token_ids.shape
        K = anchors.shape[1]
        eps, D = cfg.rms_norm_eps, cfg.head_dim
        ctx = rms_norm(taps @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # [N, L, H]
        block_ids = torch.full((N, K, B), cfg.mask_token_id, dtype=torch.int64)
        block_ids[:, :, 0] = token_ids.gather(1, anchors)
        x = F.embedding(block_ids.view(N, K * B), self.embed) * cfg.input_embedding_scale  # [N, KB, H]
        block_pos = (anchors[..., None] + torch.arange(B)).view(N, K * B)  # [N, KB]
        ctx_cos, ctx_sin = self.rotary.cos_sin(torch.arange(L), x.dtype)  # [L, D]
        blk_cos, blk_sin = (t.view(N, 1, K * B, D) for t in self.rotary.cos_sin(block_pos.flatten(), x.dtype))
        sees_ctx = torch.arange(L)[None, None, :] < anchors.repeat_interleave(B, dim=1)[..., None]  # [N, KB, L]
        block_of = torch.arange(K).repeat_interleave(B)
        sees_block = (block_of[:, None] == block_of[None, :]).expand(N, K * B, K * B)  # [N, KB, KB]
        mask = torch.cat([sees_ctx, sees_block], dim=-1)[:, None]  # [N, 1, KB, L+KB]
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], eps)

            def proj(t, name, p=p):
                return t @ w[p + f"self_attn.{name}.weight"].T  # [N, n, heads*D]

            q = rms_norm(proj(h, "q_proj").view(N, K * B, -1, D), w[p + "self_attn.q_norm.weight"], eps)
            q = apply_rotary(q.transpose(1, 2), blk_cos, blk_sin)  # [N, heads, KB, D]
            k_ctx = rms_norm(proj(ctx, "k_proj").view(N, L, -1, D), w[p + "self_attn.k_norm.weight"], eps)
            k_blk = rms_norm(proj(h, "k_proj").view(N, K * B, -1, D), w[p + "self_attn.k_norm.weight"], eps)
            keys = torch.cat(
                [
                    apply_rotary(k_ctx.transpose(1, 2), ctx_cos, ctx_sin),
                    apply_rotary(k_blk.transpose(1, 2), blk_cos, blk_sin),
                ],
                dim=2,
            )  # [N, kv, L+KB, D]
            values = torch.cat(
                [proj(ctx, "v_proj").view(N, L, -1, D), proj(h, "v_proj").view(N, K * B, -1, D)], dim=1
            ).transpose(1, 2)  # [N, kv, L+KB, D]
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)  # [N, heads, KB, D]
            x = x + attn.transpose(1, 2).reshape(N, K * B, -1) @ w[p + "self_attn.o_proj.weight"].T
            mlp = tuple(w[p + f"mlp.{m}_proj.weight"] for m in ("gate", "up", "down"))
            x = x + swiglu(rms_norm(x, w[p + "post_attention_layernorm.weight"], eps), *mlp)
        hidden = rms_norm(x, w["norm.weight"], eps).view(N, K, B, -1)[:, :, 1:]  # [N, K, B-1, H]
        return hidden @ self.lm_head.T * cfg.output_multiplier

    def loss(self, data: TrainingData, rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Position-weighted cross-entropy of position k predicting the token at anchor+k."""
        B, K = self.settings.block_size, self.settings.anchors_per_sequence
        ids, taps = data.token_ids[rows], data.taps[rows].float()  # [N, L], [N, L, n_taps*H]
        high = ids.shape[1] - B + 1
        if high <= data.prompt_len:
            raise ValueError(f"sequences of {ids.shape[1]} tokens leave no room for a block of {B} after the prompt")
        anchors = torch.randint(data.prompt_len, high, (len(rows), K), generator=generator)  # [N, K]
        logits = self.block_logits(ids, taps, anchors)  # [N, K, B-1, V]
        labels = ids.gather(1, (anchors[..., None] + torch.arange(1, B)).view(len(rows), -1)).view(len(rows), K, B - 1)
        weights = torch.exp(-torch.arange(B - 1, dtype=torch.float32) / self.settings.decay)  # [B-1]
        ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
        return (ce * weights).sum() / (weights.sum() * len(rows) * K)

    def train(self, data: TrainingData, *, progress: bool = False) -> TrainResult:
        s = self.settings
        params = list(self.weights.values())
        optimizer = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)

        def progress_at(step: int) -> float:
            """Share of the budget spent: steps, or wall time when that runs out first."""
            by_steps = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
            by_time = (time.perf_counter() - started) / (60 * s.minutes) if s.minutes is not None else 0.0
            return max(by_steps, by_time)

        def lr_factor(step: int) -> float:
            if step < s.warmup_steps:
                return (step + 1) / s.warmup_steps
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress_at(step))))

        generator = torch.Generator().manual_seed(s.seed)
        order = random.Random(s.seed)
        started, losses = time.perf_counter(), []
        bar = tqdm(range(s.steps), desc="train drafter", disable=not progress)
        for step in bar:
            for group in optimizer.param_groups:
                group["lr"] = s.lr * lr_factor(step)
            rows = torch.tensor(order.sample(range(len(data.token_ids)), min(s.batch_sequences, len(data.token_ids))))
            loss = self.loss(data, rows, generator)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
            optimizer.step()
            losses.append(float(loss.detach()))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if s.minutes is not None and time.perf_counter() - started > 60 * s.minutes:
                break
        return TrainResult(losses=tuple(losses), steps=len(losses), seconds=time.perf_counter() - started)

    def save(self, directory: Path | str, dtype: torch.dtype = torch.float16) -> Path:
        """Write config.json + model.safetensors in the published DFlash layout."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(
            {n: p.detach().to(dtype).contiguous() for n, p in self.weights.items()},
            str(directory / "model.safetensors"),
        )
        (directory / "config.json").write_text(
            json.dumps(self.raw_config | {"torch_dtype": str(dtype).split(".")[-1]}, indent=2)
        )
        return directory


def text_prompts(tokenizer, files: Sequence[Path], *, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` token windows of `length` tokens taken at random offsets of the given text files."""
    streams = [tokenizer.encode(Path(f).read_text(errors="replace")) for f in files]
    streams = [s for s in streams if len(s) > length]
    if not streams:
        raise ValueError(f"no data file holds more than {length} tokens")
    rng = random.Random(seed)
    windows = []
    for _ in range(count):
        stream = rng.choice(streams)
        start = rng.randrange(len(stream) - length)
        windows.append(stream[start : start + length])
    return windows
