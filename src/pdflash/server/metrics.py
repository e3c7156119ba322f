"""Server metrics: a Prometheus registry per app, per-request trackers, the engine-wide board.

Owns every number the server reports: Prometheus series (its own CollectorRegistry, so two
apps in one process never share counters), the per-request delta bookkeeping both the
HTTP and websocket surfaces use (new acceptance lengths, expert bytes, TTFT, inter-token
gaps), and the engine-wide snapshot the websocket `stats` messages carry. Must not touch
engine state: it only reads `engine.stats()` and request outputs.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from pdflash.engine.outputs import RequestOutput
from pdflash.measure import tokens_per_second

ENDPOINTS = ("/", "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/ws")
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ACCEPTANCE_BUCKETS = tuple(float(n) for n in range(1, 17))
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def endpoint_label(path: str) -> str:
    """A bounded label for a request path (unknown paths share one label)."""
    if path in ENDPOINTS:
        return path
    if path.startswith("/static/"):
        return "/static"
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"


class ServerMetrics:
    """The app's Prometheus series; engine-derived ones are read from `engine.stats()` at scrape time."""

    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # one declaration per series; what repeats below is prometheus_client's constructor shape, not logic
        self.requests = Counter(
            "pdflash_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.ws_connections = Gauge("pdflash_ws_connections", "open websocket connections", registry=r)
        self.ws_messages = Counter(
            "pdflash_ws_messages", "websocket client messages by type (invalid: rejected)", ["type"], registry=r
        )
        self.ws_generations = Counter(
            "pdflash_ws_generations", "websocket generations by outcome", ["outcome"], registry=r
        )
        self.prompt_tokens = Counter("pdflash_prompt_tokens", "prompt tokens of served requests", registry=r)
        self.generated_tokens = Counter("pdflash_generated_tokens", "tokens streamed to clients", registry=r)
        self.ttft = Histogram(
            "pdflash_time_to_first_token_seconds", "arrival to first token", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.itl = Histogram(
            "pdflash_inter_token_latency_seconds",
            "gap between deltas divided by the tokens in the delta, one sample per token",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.acceptance = Histogram(
            "pdflash_acceptance_length",
            "tokens emitted per verify round, bonus included",
            buckets=ACCEPTANCE_BUCKETS,
            registry=r,
        )
        self.block = Histogram(
            "pdflash_verify_block_tokens",
            "tokens verified per round: the speculation policy's block (1 = plain decoding)",
            buckets=ACCEPTANCE_BUCKETS,
            registry=r,
        )
        self.admission_wait = Histogram(
            "pdflash_request_admission_wait_seconds",
            "a request's total verify admission wait",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.expert_bytes = Counter(
            "pdflash_expert_bytes_projected", "projected expert-union bytes of served verify rounds", registry=r
        )
        self.fetch_bytes = Counter(
            "pdflash_fetch_bytes_projected", "the part of the projected bytes not resident when projected", registry=r
        )
        r.register(EngineCollector(engine))
        self.projected_expert_bytes = 0  # plain totals of the two counters above (read by the stats board)
        self.projected_fetch_bytes = 0

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """Engine and expert-cache series, read from `engine.stats()` on every scrape."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def describe(self) -> list:
        return []  # series depend on whether the engine has an expert provider

    def collect(self):
        s = self.engine.stats()
        yield GaugeMetricFamily("pdflash_live_sequences", "admitted sequences holding KV", value=s.live_sequences)
        yield GaugeMetricFamily("pdflash_waiting_requests", "queued requests not yet admitted", value=s.waiting)
        yield GaugeMetricFamily("pdflash_kv_cache_bytes", "KV cache bytes held by live sequences", value=s.kv_bytes)
        outcomes = CounterMetricFamily("pdflash_engine_requests", "engine requests by outcome", labels=["outcome"])
        for outcome in ("finished", "aborted", "failed"):
            outcomes.add_metric([outcome], getattr(s, outcome))
        yield outcomes
        yield CounterMetricFamily("pdflash_verify_rounds", "per-sequence verify rounds", value=s.verify_rounds)
        yield CounterMetricFamily(
            "pdflash_prefills_held",
            "requests whose prefill waited for a seated sequence about to reach its length limit",
            value=s.prefills_held,
        )
        yield CounterMetricFamily(
            "pdflash_prefills_in_verifies",
            "prompts prefilled inside a batched verify's forward",
            value=s.prefills_in_verifies,
        )
        yield GaugeMetricFamily(
            "pdflash_mean_acceptance_length", "tokens per verify round since start", value=s.mean_acceptance_length
        )
        yield CounterMetricFamily(
            "pdflash_drafts_vetoed",
            "rounds the speculation policy would have drafted, kept plain: recent blocks committed fewer tokens/s",
            value=s.drafts_vetoed,
        )
        for q in ("p50", "p99"):
            value = getattr(s, f"admission_wait_{q}_s")
            if value is not None:
                yield GaugeMetricFamily(
                    f"pdflash_admission_wait_{q}_seconds",
                    f"verify admission wait {q} over the scheduler's window",
                    value=value,
                )
        yield _batch_histogram(s.verify_batch_sizes)
        yield from _provider_metrics(s.provider)


def _batch_histogram(sizes: dict[int, int]) -> HistogramMetricFamily:
    buckets = [(str(le), sum(n for size, n in sizes.items() if size <= le)) for le in BATCH_BUCKETS]
    buckets.append(("+Inf", sum(sizes.values())))
    return HistogramMetricFamily(
        "pdflash_verify_batch_size",
        "sequences per batched verify forward",
        buckets=buckets,
        sum_value=sum(size * n for size, n in sizes.items()),
    )


def _provider_metrics(p: dict | None):
    if not p:
        return
    yield CounterMetricFamily(
        "pdflash_expert_bytes_fetched", "expert bytes copied host-to-device", value=p["expert_bytes_fetched"]
    )
    yield GaugeMetricFamily(
        "pdflash_expert_cache_hit_rate",
        "routed expert bytes found resident / all needed",
        value=p["expert_cache_hit_rate"],
    )
    yield GaugeMetricFamily("pdflash_expert_cache_bytes", "device expert cache budget", value=p["expert_cache_bytes"])
    yield CounterMetricFamily("pdflash_expert_evictions", "experts evicted from the device cache", value=p["evictions"])
    yield CounterMetricFamily(
        "pdflash_exposed_fetch_seconds", "time forwards waited for expert fetches", value=p["exposed_fetch_s"]
    )
    yield CounterMetricFamily(
        "pdflash_link_busy_seconds", "time the host-to-device link carried expert fetches", value=p["link_busy_s"]
    )
    info = GaugeMetricFamily(
        "pdflash_expert_link_info", "host-to-device link kind (emulated: simulated bandwidth)", labels=["link"]
    )
    info.add_metric([p["link"]], 1)
    yield info
    if p.get("link_bytes_per_s") is not None:
        yield GaugeMetricFamily(
            "pdflash_expert_link_bytes_per_second",
            "the host-to-device rate expert copies are priced at (emulated, or measured at start)",
            value=p["link_bytes_per_s"],
        )


@attrs.frozen(kw_only=True)
class Delta:
    """What one output delta adds, beyond its text and token ids."""

    acceptance_lengths: tuple[int, ...]  # verify rounds completed since the previous delta
    block_sizes: tuple[int, ...]  # tokens those rounds verified (the speculation policy's choice)
    expert_bytes: int  # their projected expert-union bytes
    fetch_bytes: int  # the part not resident when projected


class RequestTracker:
    """Follows one request's deltas: records metrics and says what each delta adds."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.rounds = 0
        self.expert_bytes = 0
        self.fetch_bytes = 0
        self.tokens = 0
        self.first_at: float | None = None
        self.last_at: float | None = None

    def update(self, out: RequestOutput) -> Delta:
        m, now, n = out.metrics, time.perf_counter(), len(out.token_ids)
        if n:
            if self.first_at is None:
                self.first_at = now
                self.metrics.prompt_tokens.inc(m.prompt_tokens)
                if m.ttft_s is not None:
                    self.metrics.ttft.observe(m.ttft_s)
            elif self.last_at is not None:
                gap = (now - self.last_at) / n
                for _ in range(n):
                    self.metrics.itl.observe(gap)
            self.last_at = now
            self.tokens += n
            self.metrics.generated_tokens.inc(n)
        rounds = m.acceptance_lengths[self.rounds :]
        for length in rounds:
            self.metrics.acceptance.observe(length)
        blocks = m.block_sizes[self.rounds :]
        for block in blocks:
            self.metrics.block.observe(block)
        delta = Delta(
            acceptance_lengths=tuple(rounds),
            block_sizes=tuple(blocks),
            expert_bytes=m.expert_bytes - self.expert_bytes,
            fetch_bytes=m.fetch_bytes - self.fetch_bytes,
        )
        self.metrics.expert_bytes.inc(delta.expert_bytes)
        self.metrics.fetch_bytes.inc(delta.fetch_bytes)
        self.metrics.projected_expert_bytes += delta.expert_bytes
        self.metrics.projected_fetch_bytes += delta.fetch_bytes
        self.rounds, self.expert_bytes, self.fetch_bytes = len(m.acceptance_lengths), m.expert_bytes, m.fetch_bytes
        if out.finished:
            self.metrics.admission_wait.observe(m.admission_wait_s)
        return delta

    def summary(self, out: RequestOutput) -> dict[str, Any]:
        """The request's metrics as of `out` (the final delta carries the session's round stats too)."""
        m = out.metrics
        lengths = list(m.acceptance_lengths)
        return (m.session_stats or {}) | {
            "prompt_tokens": m.prompt_tokens,
            "generated_tokens": m.generated_tokens,
            "acceptance_lengths": lengths,
            "block_sizes": list(m.block_sizes),
            "mean_acceptance_length": sum(lengths) / len(lengths) if lengths else 0.0,
            "ttft_s": m.ttft_s,
            "tokens_per_second": tokens_per_second(self.tokens, self.first_at or 0.0, self.last_at or 0.0),
            "expert_bytes": m.expert_bytes,
            "fetch_bytes": m.fetch_bytes,
            "admission_wait_s": m.admission_wait_s,
        }


class StatsBoard:
    """The engine-wide numbers of the websocket `stats` message, recomputed at most every `interval_s`.

    Shared by every socket of an app, so many clients cost one `engine.stats()` per interval.
    """

    def __init__(self, engine: Any, metrics: ServerMetrics, model: str, interval_s: float) -> None:
        self.engine, self.metrics, self.model, self.interval_s = engine, metrics, model, interval_s
        self._at = -float("inf")
        self._tokens = 0
        self._current: dict[str, Any] = {}

    def current(self) -> dict[str, Any]:
        now = time.perf_counter()
        if now - self._at >= self.interval_s:
            self._current = self._compute(now)
        return self._current

    def _compute(self, now: float) -> dict[str, Any]:
        s = self.engine.stats()
        rate = (s.generated_tokens - self._tokens) / (now - self._at) if self._at > -float("inf") else 0.0
        self._at, self._tokens = now, s.generated_tokens
        p = s.provider or {}
        return {
            "type": "stats",
            "model": self.model,
            "live_sequences": s.live_sequences,
            "waiting": s.waiting,
            "generated_tokens": s.generated_tokens,
            "tokens_per_second": rate,
            "mean_acceptance_length": s.mean_acceptance_length,
            "drafts_vetoed": s.drafts_vetoed,
            "expert_bytes_projected": self.metrics.projected_expert_bytes,
            "fetch_bytes_projected": self.metrics.projected_fetch_bytes,
            "expert_bytes_fetched": p.get("expert_bytes_fetched"),
            "expert_cache_hit_rate": p.get("expert_cache_hit_rate"),
            "expert_cache_bytes": p.get("expert_cache_bytes"),
            "link": p.get("link"),
        }
