"""Sampling parameters (validated once) and the token choice from logits."""

from __future__ import annotations

import math

import attrs
import torch


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@attrs.frozen(kw_only=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 = all tokens
    max_tokens: int = 64  # new tokens at most
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)  # finish after any of these
    stop: tuple[str, ...] = attrs.field(default=(), converter=lambda s: (s,) if isinstance(s, str) else tuple(s))
    seed: int | None = None  # per-request generator seed

    def __attrs_post_init__(self) -> None:
        _check(
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0,
            f"temperature must be a finite number >= 0, got {self.temperature!r}",
        )
        _check(
            isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
            f"top_p must be in (0, 1], got {self.top_p!r}",
        )
        _check(
            isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0,
            f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}",
        )
        _check(
            isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and self.max_tokens >= 1,
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(
            all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)!r}",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            f"stop must be non-empty strings, got {list(self.stop)!r}",
        )
        _check(
            self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
            f"seed must be an integer or None, got {self.seed!r}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        if self.greedy:
            return None
        generator = torch.Generator(device=device)
        if self.seed is not None:
            generator.manual_seed(self.seed)
        else:
            generator.seed()
        return generator


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, V] float32 logits → [R, V] the distribution the request samples from (temperature>0)."""
    scores = logits.float() / params.temperature  # [R, V]
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]  # [R, 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p  # mass before this token already enough
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """[R, V] logits → [R] token ids: argmax when greedy, else a draw from `probabilities`."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return torch.multinomial(probabilities(logits, params), 1, generator=generator).squeeze(-1)
