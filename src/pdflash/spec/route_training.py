"""Trains a route head (pdflash.spec.projection.route_head) against a frozen target, and scores it.

Owns the training data (token windows and the experts the target routes each position to,
from full target forwards), the loss (binary cross-entropy of each expert being in a token's
top-k), the optimiser loop, and the held-out block score: coverage and waste by bytes of the
head's projected union of consecutive blocks beside the previous block's union (what the
`last-union` projector would have charged). The target stays frozen and is only read.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import attrs
import torch
import torch.nn.functional as F

from pdflash.spec.projection.route_head import RouteHead
from pdflash.target.experts import ExpertKey


@attrs.frozen(kw_only=True)
class RouteData:
    token_ids: torch.Tensor  # [S, T] int64 windows
    routed: torch.Tensor  # [S, T, L_moe, E] bool: expert e of MoE layer l is in position t's top-k


@attrs.frozen(kw_only=True)
class RouteTrainSettings:
    context_tokens: int = 3
    threshold: float = 0.3
    steps: int = 3000
    rows_per_step: int = 16  # windows per step (every position of each is trained on)
    lr: float = 3e-3
    weight_decay: float = 0.01
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        for name in ("context_tokens", "steps", "rows_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {self.threshold}")


@attrs.frozen(kw_only=True)
class BlockScore:
    """Mean over held-out blocks: the head's union and the previous block's, both against the block's own."""

    blocks: int
    coverage_bytes: float  # head: bytes(projected ∩ actual) / bytes(actual)
    waste_bytes: float  # head: bytes(projected − actual) per block
    baseline_coverage_bytes: float  # the previous block's union (last-union)
    baseline_waste_bytes: float


def build_route_data(model, windows: Sequence[Sequence[int]], *, batch: int = 64) -> RouteData:
    """Run each window through the target (every window the same length) and keep what it routed."""
    lengths = {len(w) for w in windows}
    if len(lengths) != 1 or not windows:
        raise ValueError(f"windows must be non-empty and share one length, got lengths {sorted(lengths)}")
    ids = torch.tensor([list(w) for w in windows], dtype=torch.int64)  # [S, T]
    cfg = model.config
    hot = []
    for start in range(0, len(ids), batch):
        chunk = list(ids[start : start + batch])
        out = model.forward(chunk, [model.new_cache() for _ in chunk], last_logits_only=True)
        routed = out.routed.cpu().view(len(chunk), ids.shape[1], len(cfg.moe_layer_ids), cfg.top_k)
        hot.append(torch.zeros(*routed.shape[:3], cfg.num_experts, dtype=torch.bool).scatter_(-1, routed, True))
    return RouteData(token_ids=ids, routed=torch.cat(hot))


def train_route_head(model, data: RouteData, settings: RouteTrainSettings) -> tuple[RouteHead, tuple[float, ...]]:
    """Fit a head to `data` (AdamW, cosine schedule); returns it and the per-step losses."""
    generator = torch.Generator().manual_seed(settings.seed)
    head = RouteHead.initial(
        model.config, context_tokens=settings.context_tokens, threshold=settings.threshold, generator=generator
    )
    prior = data.routed.float().mean(dim=(0, 1)).clamp(1e-3, 1 - 1e-3).flatten()  # [L_moe*E] routing frequency
    weight, bias = torch.nn.Parameter(head.weight), torch.nn.Parameter(torch.logit(prior))  # start at the prior
    trainable = attrs.evolve(head, weight=weight, bias=bias)
    embed = model.embed.detach().cpu().float()  # [V, H] frozen
    optimizer = torch.optim.AdamW([weight, bias], lr=settings.lr, weight_decay=settings.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + torch.cos(torch.tensor(torch.pi * step / settings.steps)).item())
    )
    order = random.Random(settings.seed)
    rows_total, T = data.token_ids.shape
    losses = []
    for _ in range(settings.steps):
        rows = torch.tensor(order.sample(range(rows_total), min(settings.rows_per_step, rows_total)))
        logits = trainable.logits(trainable.features(embed, data.token_ids[rows], T))  # [R, T, L_moe, E]
        loss = F.binary_cross_entropy_with_logits(logits, data.routed[rows].float())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
    return attrs.evolve(head, weight=weight.detach().clone(), bias=bias.detach().clone()), tuple(losses)


def score_blocks(
    head: RouteHead, model, data: RouteData, expert_nbytes: dict[ExpertKey, int], *, block_size: int
) -> BlockScore:
    """Cut each window into consecutive blocks; score the head on every block after the first."""
    cfg = model.config
    nbytes = torch.tensor(
        [[expert_nbytes[(layer, e)] for e in range(cfg.num_experts)] for layer in cfg.moe_layer_ids],
        dtype=torch.float64,
    )  # [L_moe, E]
    embed = model.embed.detach().cpu().float()
    S, T = data.token_ids.shape
    n_blocks = T // block_size
    if n_blocks < 2:
        raise ValueError(f"windows of {T} tokens hold fewer than two blocks of {block_size}")
    with torch.no_grad():
        logits = head.logits(head.features(embed, data.token_ids, T))  # [S, T, L_moe, E]
    cut = n_blocks * block_size
    blocks = logits[:, :cut].unflatten(1, (n_blocks, block_size))  # [S, nb, B, L_moe, E]
    projected = head.union_probability(blocks) > head.threshold  # [S, nb, L_moe, E]
    actual = data.routed[:, :cut].unflatten(1, (n_blocks, block_size)).any(dim=2)  # [S, nb, L_moe, E]
    projected, previous, actual = projected[:, 1:], actual[:, :-1], actual[:, 1:]

    def by_bytes(mask: torch.Tensor) -> torch.Tensor:
        return (mask * nbytes).sum(dim=(-2, -1))  # [S, nb-1]

    total = by_bytes(actual)
    return BlockScore(
        blocks=int(total.numel()),
        coverage_bytes=float((by_bytes(projected & actual) / total).mean()),
        waste_bytes=float(by_bytes(projected & ~actual).mean()),
        baseline_coverage_bytes=float((by_bytes(previous & actual) / total).mean()),
        baseline_waste_bytes=float(by_bytes(previous & ~actual).mean()),
    )
