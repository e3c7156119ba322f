"""Reports of a sweep: the Markdown table, the JSON document and the PNG plots.

Owns presentation only: columns, units, the header that states machine, regime (R, link
rate, cache share) and source of every figure, and the three plots (tokens/s vs
concurrency per configuration; p99 inter-token latency vs tokens/s; bytes per token).
"""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Sequence
from pathlib import Path

import torch

from pdflash.bench.configs import CONFIGS
from pdflash.bench.metrics import PointResult

COLUMNS = (
    ("tok/s", "tokens_per_s", ".1f"),
    ("ms/token", "ms_per_token", ".2f"),
    ("TTFT p50 ms", "ttft_p50_ms", ".0f"),
    ("ITL p50 ms", "itl_p50_ms", ".1f"),
    ("ITL p99 ms", "itl_p99_ms", ".1f"),
    ("τ", "tau", ".2f"),
    ("kB fetched/token", "bytes_per_token", "kB"),
    ("hit rate", "hit_rate", ".1%"),
    ("coverage (bytes)", "projection_coverage_bytes", ".1%"),
    ("exposed fetch", "exposed_fetch_share", ".0%"),
    ("adm. wait p50/p99 ms", "admission_wait", "pair"),
    ("Jain", "fairness", ".3f"),
    ("link busy", "link_busy_share", ".0%"),
    ("overhead", "engine_overhead", ".0%"),
)


def machine() -> str:
    return (
        f"{platform.machine()}, {os.cpu_count()} CPU cores (shared with other jobs), no accelerator, "
        f"torch {torch.__version__} with {torch.get_num_threads()} intra-op thread(s), Python {platform.python_version()}"
    )


def _cell(point: PointResult, key: str, fmt: str) -> str:
    if fmt == "pair":
        return f"{point.admission_wait_p50_ms:.1f} / {point.admission_wait_p99_ms:.1f}"
    value = getattr(point, key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if fmt == "kB":
        return f"{value / 1e3:,.0f}"
    return format(value, fmt)


def markdown_table(points: Sequence[PointResult]) -> str:
    lines = [
        "| config | c | " + " | ".join(name for name, _, _ in COLUMNS) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in COLUMNS) + " |",
    ]
    for p in points:
        label = CONFIGS[p.config].label if p.config in CONFIGS else ""
        cells = " | ".join(_cell(p, key, fmt) for _, key, fmt in COLUMNS)
        lines.append(f"| {label} {p.config} | {p.concurrency} | {cells} |")
    return "\n".join(lines)


def write_json(path: Path | str | None, header: dict, points: Sequence[PointResult]) -> str:
    """The report as one JSON object {header fields..., "results": [...]}; written to `path` unless None."""
    text = json.dumps(header | {"results": [p.as_dict() for p in points]}, indent=1, default=str)
    if path is not None:
        Path(path).write_text(text)
    return text


def plot(points: Sequence[PointResult], prefix: Path | str, title: str) -> list[Path]:
    """Three PNGs next to `prefix`: -throughput, -latency, -bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_config: dict[str, list[PointResult]] = {}
    for p in points:
        by_config.setdefault(p.config, []).append(p)
    paths = []
    specs = (
        ("throughput", "concurrency", "output tokens/s", lambda p: p.concurrency, lambda p: p.tokens_per_s, True),
        ("latency", "output tokens/s", "ITL p99 (ms)", lambda p: p.tokens_per_s, lambda p: p.itl_p99_ms, False),
        (
            "bytes",
            "concurrency",
            "expert kB fetched / token",
            lambda p: p.concurrency,
            lambda p: p.bytes_per_token / 1e3,
            True,
        ),
    )
    for name, xlabel, ylabel, fx, fy, log_x in specs:
        fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
        for config, pts in by_config.items():
            if name == "bytes" and config in CONFIGS and not CONFIGS[config].offloaded:
                continue
            pts = sorted(pts, key=lambda p: p.concurrency)
            ax.plot([fx(p) for p in pts], [fy(p) for p in pts], marker="o", label=config)
        if log_x:
            ax.set_xscale("log", base=2)
        if name == "throughput":  # resident runs are an order of magnitude faster: log scales
            ax.set_yscale("log")
        elif name == "latency":
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = Path(f"{prefix}-{name}.png")
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def validation_table(measured: Sequence[PointResult], simulated: Sequence[PointResult]) -> tuple[str, float]:
    """Measured vs simulated tokens/s and bytes/token per point, with relative errors; and the worst error."""
    sim = {(p.config, p.concurrency): p for p in simulated}
    lines = [
        "| config | c | measured tok/s | simulated tok/s | error | measured kB/token | simulated kB/token | error |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    worst = 0.0
    for m in measured:
        s = sim.get((m.config, m.concurrency))
        if s is None:
            continue
        e_rate = s.tokens_per_s / m.tokens_per_s - 1
        e_bytes = s.bytes_per_token / m.bytes_per_token - 1 if m.bytes_per_token else 0.0
        worst = max(worst, abs(e_rate), abs(e_bytes))
        lines.append(
            f"| {m.config} | {m.concurrency} | {m.tokens_per_s:.1f} | {s.tokens_per_s:.1f} | {e_rate:+.1%} | "
            f"{m.bytes_per_token / 1e3:,.0f} | {s.bytes_per_token / 1e3:,.0f} | {e_bytes:+.1%} |"
        )
    return "\n".join(lines), worst
