"""Deployment profiles: a model's published shapes, an accelerator, a host link and an expert budget.

Owns the profile data file (profiles.json, shipped with the package, every figure with its
source), its validation (a bad file names the field) and the arithmetic that follows from
shapes alone: bytes per expert as stored, one token's routed bytes, the regime ratio R.
Must not touch engines, links or caches: runners and the simulator read these numbers.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any, cast

import attrs

BF16_BYTES = 2
MXFP4_BLOCK = 32  # values per MXFP4 block: 16 bytes of 4-bit values plus one 1-byte scale


class ProfileError(ValueError):
    """A profile file or name is invalid (the message names the field)."""


@attrs.frozen(kw_only=True)
class ModelShape:
    """An MoE model's shapes as published in its config.json."""

    name: str
    source: str  # where the numbers come from
    num_hidden_layers: int
    num_experts: int
    num_experts_per_tok: int
    hidden_size: int
    moe_intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    expert_format: str  # "bf16" | "mxfp4" (packed blocks + scales + bf16 biases) | "fp16" | "fp32"
    drafter_layers: int
    drafter_intermediate_size: int
    drafter_source: str

    @property
    def expert_bytes(self) -> int:
        """Payload bytes of one expert as stored (gate, up and down projections)."""
        H, I = self.hidden_size, self.moe_intermediate_size
        if self.expert_format == "mxfp4":  # gpt-oss: gate_up [2I, H] and down [H, I] in MXFP4, biases bf16
            packed = 2 * I * H + H * I
            return packed // 2 + packed // MXFP4_BLOCK + (2 * I + H) * BF16_BYTES
        return 3 * H * I * {"bf16": 2, "fp16": 2, "fp32": 4}[self.expert_format]

    @property
    def token_routed_bytes(self) -> int:
        """Bytes of the experts one token routes to: layers x top-k experts."""
        return self.num_hidden_layers * self.num_experts_per_tok * self.expert_bytes

    @property
    def all_expert_bytes(self) -> int:
        return self.num_hidden_layers * self.num_experts * self.expert_bytes

    def _attention_params(self) -> int:
        H, D = self.hidden_size, self.head_dim
        return H * (self.num_attention_heads + 2 * self.num_key_value_heads) * D + self.num_attention_heads * D * H

    @property
    def dense_bytes_per_forward(self) -> int:
        """bf16 bytes of the non-expert weights one target forward reads (attention, routers, LM head)."""
        per_layer = self._attention_params() + self.hidden_size * self.num_experts
        return (self.num_hidden_layers * per_layer + self.vocab_size * self.hidden_size) * BF16_BYTES

    @property
    def router_pass_bytes(self) -> int:
        """bf16 bytes a router-only pass reads: attention and routers, no experts, no LM head."""
        per_layer = self._attention_params() + self.hidden_size * self.num_experts
        return self.num_hidden_layers * per_layer * BF16_BYTES

    @property
    def drafter_bytes_per_forward(self) -> int:
        """bf16 bytes of one drafter forward: its layers plus the target's LM head it shares."""
        mlp = 3 * self.hidden_size * self.drafter_intermediate_size
        return (
            self.drafter_layers * (self._attention_params() + mlp) + self.vocab_size * self.hidden_size
        ) * BF16_BYTES

    @property
    def active_params_per_token(self) -> int:
        expert = 3 * self.hidden_size * self.moe_intermediate_size
        return self.dense_bytes_per_forward // BF16_BYTES + self.num_hidden_layers * self.num_experts_per_tok * expert


@attrs.frozen(kw_only=True)
class Accelerator:
    name: str
    source: str
    hbm_bytes_per_s: float
    peak_flops: float  # dense bf16 FLOP/s
    per_layer_fixed_s: float  # launch, attention and routing overheads per layer per forward
    per_layer_fixed_source: str


@attrs.frozen(kw_only=True)
class HostLink:
    name: str
    source: str
    h2d_bytes_per_s: float  # pinned host-to-device copy rate


@attrs.frozen(kw_only=True)
class Profile:
    """One deployment: model on accelerator behind a host link, with a device budget for experts."""

    name: str
    model: ModelShape
    accelerator: Accelerator
    link: HostLink
    expert_budget_bytes: int

    def forward_s(self, tokens: int, distinct_experts: int, weight_bytes: int | None = None) -> float:
        """Roofline time of one target forward over `tokens` whose batch routes `distinct_experts`
        (summed over layers): per-layer fixed cost + max(HBM time of the weights read, FLOP time)."""
        m, a = self.model, self.accelerator
        read = (m.dense_bytes_per_forward if weight_bytes is None else weight_bytes) + distinct_experts * m.expert_bytes
        flops = 2 * tokens * m.active_params_per_token
        return m.num_hidden_layers * a.per_layer_fixed_s + max(read / a.hbm_bytes_per_s, flops / a.peak_flops)

    @property
    def ar_step_s(self) -> float:
        """One autoregressive decode step at batch 1 (one token, top-k experts per layer)."""
        m = self.model
        return self.forward_s(1, m.num_hidden_layers * m.num_experts_per_tok)

    @property
    def token_fetch_s(self) -> float:
        """Time to move one token's routed experts over the link."""
        return self.model.token_routed_bytes / self.link.h2d_bytes_per_s

    @property
    def regime_ratio(self) -> float:
        """R = one token's expert fetch time / one AR step's compute."""
        return self.token_fetch_s / self.ar_step_s

    @property
    def cache_share(self) -> float:
        """The expert budget as a share of all expert bytes (at most 1)."""
        return min(1.0, self.expert_budget_bytes / self.model.all_expert_bytes)


_FIELDS: dict[str, dict[str, str]] = {  # section -> field -> type name (the annotations are strings)
    section: {f.name: str(f.type) for f in attrs.fields(cls) if f.name != "name"}
    for section, cls in (("models", ModelShape), ("accelerators", Accelerator), ("links", HostLink))
}
_KINDS: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float), "str": str}
EXPERT_FORMATS = ("bf16", "fp16", "fp32", "mxfp4")


def _checked(where: str, raw: Any, fields: dict[str, str]) -> dict:
    if not isinstance(raw, dict):
        raise ProfileError(f"{where} must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ProfileError(f"{where} has unknown field(s) {unknown}; valid: {sorted(fields)}")
    out = {}
    for name, kind in fields.items():
        if name not in raw:
            raise ProfileError(f"{where}.{name} is missing")
        value: Any = raw[name]
        if isinstance(value, bool) or not isinstance(value, _KINDS[kind]):
            raise ProfileError(f"{where}.{name}={value!r} must be of type {kind}")
        if kind != "str":
            zero_ok = name.endswith("fixed_s")  # a fixed cost may be zero, nothing else may
            number = cast(float, value)
            if number < 0 or (number == 0 and not zero_ok):
                raise ProfileError(f"{where}.{name}={value!r} must be {'>= 0' if zero_ok else '> 0'}")
        out[name] = value
    return out


def load_profiles(path: Path | str | None = None) -> dict[str, Profile]:
    """Every profile of a profile file (default: the shipped profiles.json), validated."""
    if path is None:
        text, label = resources.files("pdflash.bench").joinpath("profiles.json").read_text(), "profiles.json"
    else:
        text, label = Path(path).read_text(), str(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{label}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{label}: the top level must be an object")
    parts: dict[str, dict[str, Any]] = {}
    for section, cls in (("models", ModelShape), ("accelerators", Accelerator), ("links", HostLink)):
        entries = data.get(section)
        if not isinstance(entries, dict) or not entries:
            raise ProfileError(f"{label}: {section!r} must be a non-empty object")
        parts[section] = {
            key: cls(name=key, **_checked(f"{label}: {section}.{key}", raw, _FIELDS[section]))
            for key, raw in entries.items()
        }
    for key, model in parts["models"].items():
        if model.expert_format not in EXPERT_FORMATS:
            raise ProfileError(
                f"{label}: models.{key}.expert_format={model.expert_format!r} is not one of {EXPERT_FORMATS}"
            )
        if model.num_experts_per_tok > model.num_experts:
            raise ProfileError(
                f"{label}: models.{key}.num_experts_per_tok={model.num_experts_per_tok} exceeds "
                f"num_experts={model.num_experts}"
            )
    profiles = {}
    refs = {"model": "models", "accelerator": "accelerators", "link": "links"}
    for key, raw in (data.get("profiles") or {}).items():
        where = f"{label}: profiles.{key}"
        fields = _checked(
            where, raw, {"model": "str", "accelerator": "str", "link": "str", "expert_budget_bytes": "float"}
        )
        resolved = {}
        for field, section in refs.items():
            if fields[field] not in parts[section]:
                raise ProfileError(f"{where}.{field}={fields[field]!r} is not one of {sorted(parts[section])}")
            resolved[field] = parts[section][fields[field]]
        profiles[key] = Profile(name=key, expert_budget_bytes=int(fields["expert_budget_bytes"]), **resolved)
    if not profiles:
        raise ProfileError(f"{label}: 'profiles' must be a non-empty object")
    return profiles


def get_profile(name: str, path: Path | str | None = None) -> Profile:
    profiles = load_profiles(path)
    if name not in profiles:
        raise ProfileError(f"profile {name!r} is unknown; choose one of {', '.join(sorted(profiles))}")
    return profiles[name]


@attrs.frozen(kw_only=True)
class TimeScale:
    """An emulated link that gives the model run here a profile's regime.

    link rate = (one token's routed expert bytes here) / (R x one AR step measured here), so
    that fetch time of one token's experts / AR step = the profile's R; the cache holds the
    profile's budget share of all experts."""

    profile: str
    regime_ratio: float  # R of the profile
    ar_step_s: float  # one autoregressive step measured here (resident, batch 1)
    token_routed_bytes: int  # one token's routed expert bytes here (byte-map bytes)
    link_gbps: float  # the emulated link, GB/s (1e9 bytes/s)
    cache_fraction: float  # device cache / all expert bytes

    @classmethod
    def for_profile(cls, profile: Profile, *, ar_step_s: float, token_routed_bytes: int) -> TimeScale:
        if not ar_step_s > 0 or token_routed_bytes <= 0:
            raise ValueError(
                f"time scaling needs a positive AR step and routed bytes, got {ar_step_s} s, {token_routed_bytes} bytes"
            )
        R = profile.regime_ratio
        return cls(
            profile=profile.name,
            regime_ratio=R,
            ar_step_s=ar_step_s,
            token_routed_bytes=token_routed_bytes,
            link_gbps=token_routed_bytes / (R * ar_step_s) / 1e9,
            cache_fraction=profile.cache_share,
        )

    def describe(self) -> str:
        return (
            f"time-scaled to {self.profile}: R = {self.regime_ratio:.1f}, AR step here {self.ar_step_s * 1e3:.2f} ms, "
            f"{self.token_routed_bytes:,} routed bytes/token -> emulated link {self.link_gbps * 1e3:.1f} MB/s, "
            f"cache {self.cache_fraction:.1%} of all experts"
        )
