"""The trained route head: each MoE layer's routing predicted from a token and the tokens before it.

Owns the head (a linear map from the target's own embeddings of a token and its
`context_tokens − 1` predecessors to per-layer, per-expert routing logits), its file
(`route_head.safetensors` beside the drafter: DFlash checkpoints stay unchanged) and the
projector that uses it. A block's projected union holds every expert whose probability of
being routed by at least one block token, 1 − Π_j (1 − p_j), exceeds the head's threshold.
It never runs the target: the cost is one small matmul per round.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from pdflash.errors import CheckpointError
from pdflash.spec.projection.base import PROBABILITY_FLOOR, Projection
from pdflash.target.experts import ExpertKey

ROUTE_HEAD_FILE = "route_head.safetensors"
FORMAT = "pdflash-route-head/1"


@attrs.frozen(kw_only=True, eq=False)
class RouteHead:
    weight: torch.Tensor  # [L_moe*E, C*H] float32
    bias: torch.Tensor  # [L_moe*E] float32
    moe_layer_ids: tuple[int, ...]
    num_experts: int
    context_tokens: int  # C: the token itself and the C − 1 before it
    threshold: float  # union probability above which an expert is projected

    def __attrs_post_init__(self) -> None:
        rows = len(self.moe_layer_ids) * self.num_experts
        if self.context_tokens < 1:
            raise ValueError(f"context_tokens must be >= 1, got {self.context_tokens}")
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {self.threshold}")
        if self.weight.ndim != 2 or self.weight.shape[0] != rows or self.weight.shape[1] % self.context_tokens:
            raise ValueError(
                f"weight has shape {tuple(self.weight.shape)}; expected [{rows}, {self.context_tokens} × hidden] "
                f"for {len(self.moe_layer_ids)} MoE layers × {self.num_experts} experts"
            )
        if tuple(self.bias.shape) != (rows,):
            raise ValueError(f"bias has shape {tuple(self.bias.shape)}; expected [{rows}]")

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1] // self.context_tokens

    @classmethod
    def initial(cls, config, *, context_tokens: int, threshold: float, generator: torch.Generator) -> RouteHead:
        """A small random head for `config`'s target (the starting point of training)."""
        rows = len(config.moe_layer_ids) * config.num_experts
        cols = context_tokens * config.hidden_size
        return cls(
            weight=torch.randn(rows, cols, generator=generator) * cols**-0.5,
            bias=torch.zeros(rows),
            moe_layer_ids=config.moe_layer_ids,
            num_experts=config.num_experts,
            context_tokens=context_tokens,
            threshold=threshold,
        )

    def features(self, embed: torch.Tensor, tokens: torch.Tensor, n: int) -> torch.Tensor:
        """tokens [..., P + n] (P ≤ C − 1 tokens of history, then n positions) → [..., n, C*H].

        Position j's feature is the embeddings of its token and the C − 1 before it, newest
        first; history missing before the first token counts as zero embeddings.
        """
        C, P = self.context_tokens, tokens.shape[-1] - n
        emb = F.embedding(tokens, embed).float()  # [..., P+n, H]
        pad = emb.new_zeros(*emb.shape[:-2], C - 1, emb.shape[-1])
        emb = torch.cat([pad, emb], dim=-2)  # [..., C-1+P+n, H]
        first = C - 1 + P  # index of position 0 in `emb`
        return torch.cat([emb[..., first - k : first - k + n, :] for k in range(C)], dim=-1)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[..., C*H] → [..., L_moe, E] routing logits (an expert's chance of being in the token's top-k)."""
        out = F.linear(features, self.weight, self.bias)
        return out.unflatten(-1, (len(self.moe_layer_ids), self.num_experts))

    @staticmethod
    def union_probability(logits: torch.Tensor) -> torch.Tensor:
        """[..., n, L_moe, E] logits of n positions → [..., L_moe, E]: the chance each expert is routed by one at least."""
        return 1.0 - (1.0 - torch.sigmoid(logits)).prod(dim=-3)

    def union(self, probability: torch.Tensor) -> frozenset[ExpertKey]:
        """[L_moe, E] union probabilities → the (layer, expert) pairs above the threshold."""
        picked = (probability > self.threshold).nonzero().tolist()
        return frozenset((self.moe_layer_ids[i], e) for i, e in picked)

    def projection(self, probability: torch.Tensor) -> Projection:
        """[L_moe, E] union probabilities → the union above the threshold, and every expert's
        probability from PROBABILITY_FLOOR on."""
        scored = (probability >= PROBABILITY_FLOOR).nonzero()  # [n, 2] (MoE layer index, expert)
        values = probability[scored[:, 0], scored[:, 1]].tolist()
        layers = self.moe_layer_ids
        chances = {(layers[i], e): p for (i, e), p in zip(scored.tolist(), values, strict=True)}
        return Projection(self.union(probability), chances)

    # -- the file ----------------------------------------------------------------------
    def save(self, path: Path | str) -> Path:
        path = Path(path)
        meta = {
            "moe_layer_ids": list(self.moe_layer_ids),
            "num_experts": self.num_experts,
            "context_tokens": self.context_tokens,
            "threshold": self.threshold,
        }
        tensors = {"weight": self.weight.detach().half().contiguous(), "bias": self.bias.detach().half().contiguous()}
        save_file(tensors, str(path), metadata={"format": FORMAT, "config": json.dumps(meta)})
        return path

    @classmethod
    def load(cls, path: Path | str, target_config=None) -> RouteHead:
        """Read a route head file; with `target_config`, check it fits that target."""
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"{path}: no route head file")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != FORMAT:
                    raise CheckpointError(f"{path}: format {meta.get('format')!r} is not {FORMAT!r}")
                missing = {"weight", "bias"} - set(f.keys())
                if missing:
                    raise CheckpointError(f"{path}: missing tensors {sorted(missing)}")
                weight, bias = f.get_tensor("weight").float(), f.get_tensor("bias").float()
            config = json.loads(meta["config"])
            head = cls(
                weight=weight,
                bias=bias,
                moe_layer_ids=tuple(int(i) for i in config["moe_layer_ids"]),
                num_experts=int(config["num_experts"]),
                context_tokens=int(config["context_tokens"]),
                threshold=float(config["threshold"]),
            )
        except CheckpointError:
            raise
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path}: not a safetensors route head file ({exc})") from exc
        except (KeyError, TypeError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
            raise CheckpointError(f"{path}: bad route head config ({exc})") from exc
        if target_config is not None:
            head.check_fits(target_config, path)
        return head

    def check_fits(self, config, source: Path | str) -> None:
        expected = {
            "moe_layer_ids": tuple(config.moe_layer_ids),
            "num_experts": config.num_experts,
            "hidden_size": config.hidden_size,
        }
        for name, want in expected.items():
            if getattr(self, name) != want:
                raise CheckpointError(f"{source}: {name}={getattr(self, name)} but the target has {name}={want}")


class RouteHeadProjector:
    """Project each block with a trained RouteHead: no target pass, one small matmul per round."""

    name = "route-head"
    target_free = True

    def __init__(self, head: RouteHead) -> None:
        self.head = head

    def project(self, speculator, sessions, blocks: Sequence[torch.Tensor]) -> list[Projection]:
        if not blocks:
            return []
        embed = speculator.target.embed  # [V, H]
        if self.head.weight.device != embed.device:  # once: the head follows the target onto its device
            self.head = attrs.evolve(
                self.head, weight=self.head.weight.to(embed.device), bias=self.head.bias.to(embed.device)
            )
        history = self.head.context_tokens - 1
        feats = []
        for s, block in zip(sessions, blocks, strict=True):
            before = (s.prompt_ids + s.emitted)[max(0, s.start - history) : s.start]  # the tokens before the anchor
            tokens = torch.tensor(before + block.tolist(), dtype=torch.int64, device=embed.device)
            feats.append(self.head.features(embed, tokens, len(block)))  # [n_i, C*H]
        logits = self.head.logits(torch.cat(feats))  # [Σn, L_moe, E]: one matmul for every session
        return [
            self.head.projection(self.head.union_probability(part)) for part in logits.split([len(b) for b in blocks])
        ]
