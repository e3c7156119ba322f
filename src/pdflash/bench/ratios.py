"""The sweep's comparisons as paired ratios: each repeat's tokens/s against the same repeat's baseline.

Owns which configurations the issues compare (adaptive against the best of plain decoding and
fixed-block DFlash, the 2-D scheduler against token-only, resident adaptive against resident
fixed blocks and against the better of those and resident plain decoding)
and how: a sweep's repeat r runs every configuration once, back to back on the same machine
(pdflash.bench.runner.sweep), so the ratio of two configurations' r-th runs shares that
repeat's load, and the spread of those ratios over the repeats is the noise of the comparison
itself. A ratio of medians hides that spread (on two shared cores one repeat to the next moves
tokens/s by 3-8%, BENCHMARKS.md asks for medians with min-max). Presentation of figures the
runner measured; nothing is measured here.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import attrs

from pdflash.bench.metrics import PointResult

# (name, numerator, denominators): the numerator's tokens/s over the best of the denominators present
COMPARISONS = (
    ("adaptive / max(B0, B1, B2)", "adaptive", ("ar", "dflash-token", "dflash-2d")),
    ("adaptive / adaptive-token (2-D / token-only)", "adaptive", ("adaptive-token",)),
    ("dflash-2d / dflash-token (2-D / token-only)", "dflash-2d", ("dflash-token",)),
    ("resident-adaptive / resident (B=8)", "resident-adaptive", ("resident",)),
    ("resident-adaptive / max(B3p, B3) (plain, B=8)", "resident-adaptive", ("resident-ar", "resident")),
)


@attrs.frozen(kw_only=True)
class PairedRatio:
    name: str  # what is compared (COMPARISONS)
    concurrency: int
    ratios: tuple[float, ...]  # [repeats] the numerator's tokens/s / the best denominator's, repeat by repeat

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "concurrency": self.concurrency,
            "median": self.median,
            "min": min(self.ratios),
            "max": max(self.ratios),
            "ratios": list(self.ratios),
        }


def runs_of(point: PointResult) -> list[float]:
    """Tokens/s of each repeat of `point`, in the order the repeats ran ([the median alone] for a
    report written before the runs were kept)."""
    return list(point.extra.get("tokens_per_s_runs", [point.tokens_per_s]))


def paired_ratios(points: Sequence[PointResult]) -> list[PairedRatio]:
    """Every comparison whose numerator and at least one denominator ran at a concurrency, with as
    many repeats each (closed-loop sweep points; open-loop ones are left out)."""
    by_point = {(p.config, p.concurrency): runs_of(p) for p in points}
    out = []
    for name, numerator, denominators in COMPARISONS:
        for c in sorted({p.concurrency for p in points if p.config == numerator}):
            runs = by_point[(numerator, c)]
            baselines = [by_point[(d, c)] for d in denominators if (d, c) in by_point]
            if not baselines or any(len(b) != len(runs) for b in baselines):
                continue
            best = [max(column) for column in zip(*baselines, strict=True)]  # [repeats]
            out.append(PairedRatio(name=name, concurrency=c, ratios=tuple(n / b for n, b in zip(runs, best))))
    return out


def ratio_table(ratios: Sequence[PairedRatio]) -> str:
    """Markdown: one row per comparison, one column per concurrency, `median [min–max]`."""
    if not ratios:
        return ""
    levels = sorted({r.concurrency for r in ratios})
    lines = [
        "| paired ratio of tokens/s, median [min–max] over repeats | " + " | ".join(f"c={c}" for c in levels) + " |",
        "| --- | " + " | ".join("---:" for _ in levels) + " |",
    ]
    for name, _, _ in COMPARISONS:
        row = {r.concurrency: r for r in ratios if r.name == name}
        if row:
            cells = [
                f"{row[c].median:.2f} [{min(row[c].ratios):.2f}–{max(row[c].ratios):.2f}]" if c in row else "–"
                for c in levels
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
