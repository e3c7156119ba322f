"""Draws docs/architecture.png (pdflash data flow)."""

# Run: pip install -e ".[bench]" && python tools/draw_architecture.py
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

fig, ax = plt.subplots(figsize=(14, 8.4), dpi=110)
ax.set_xlim(0, 142)
ax.set_ylim(0, 84)
ax.axis("off")
GREEN, GREY, BLUE, RED, ORANGE, PURPLE = "#1d8a4e", "#6b7280", "#2457d6", "#c0392b", "#b06a00", "#7b3fbf"


def box(x, y, w, h, title, lines=(), color="#e8eefc", edge=BLUE):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.4,rounding_size=1.2", fc=color, ec=edge, lw=1.4))
    ax.text(x + w / 2, y + h - 2.0, title, ha="center", va="top", fontsize=10, weight="bold", color="#1c2230")
    for i, line in enumerate(lines):
        ax.text(x + w / 2, y + h - 5.4 - 2.85 * i, line, ha="center", va="top", fontsize=8.2, color="#333a48")


def arrow(x1, y1, x2, y2, label="", color="#444", ls="-", rad=0.0, lx=0.0, ly=0.0, style="-|>"):
    ax.add_patch(
        FancyArrowPatch(
            (x1, y1),
            (x2, y2),
            arrowstyle=style,
            mutation_scale=14,
            color=color,
            lw=1.4,
            linestyle=ls,
            connectionstyle=f"arc3,rad={rad}",
        )
    )
    if label:
        ax.text(
            (x1 + x2) / 2 + lx,
            (y1 + y2) / 2 + ly,
            label,
            fontsize=8,
            color=color,
            ha="center",
            va="center",
            bbox=dict(fc="white", ec="none", pad=0.8),
        )


ax.text(
    71,
    83,
    "pdflash: a request's path (solid) and its output stream (dashed)",
    ha="center",
    va="top",
    fontsize=12.5,
    weight="bold",
)

box(
    0.5,
    55,
    22,
    21,
    "clients",
    ["openai SDK, curl", "(HTTP + SSE)", "browser demo page", "(websocket /ws)", "Python AsyncEngine"],
    color="#f3f4f6",
    edge=GREY,
)
box(
    35,
    55,
    37,
    21,
    "pdflash.server (Starlette + uvicorn)",
    [
        "/v1/completions, /v1/chat/completions",
        "/ws: many generations per socket",
        "/metrics, /health, / (demo page)",
        "bad request: 400 / 404; full queue: 503",
        "client gone: close stream = abort",
    ],
    color="#eefaf2",
    edge=GREEN,
)
box(
    85,
    50,
    56.5,
    26,
    "AsyncEngine: one coroutine per sequence",
    [
        "generate(): validate; WAITING queue (max_waiting); seats",
        "PREFILL: await the prefill lane (batched prompts)",
        "DRAFT: await the drafter lane (batched, own thread)",
        "register the demand (tokens, expert bytes); await its ticket",
        "pacer: 1 tick per launch; N+1 admitted + prefetched while N runs",
        "VERIFY: one batched verify_rounds; accept, commit, stream",
        "each request: Sequence state machine + OutputMailbox",
    ],
)

arrow(22.9, 70, 34.6, 70, "request", ly=2.2)
arrow(72.4, 70, 84.6, 70, "generate()", ly=2.2)
arrow(84.6, 59, 72.4, 59, "deltas", color=GREEN, ls="--", ly=-2.2)
arrow(34.6, 59, 22.9, 59, "SSE / ws delta", color=GREEN, ls="--", ly=-2.2)

box(
    35,
    24,
    37,
    19,
    "engine.stats()  (read, never blocks)",
    [
        "live / waiting sequences, verify batch sizes",
        "acceptance lengths, admission waits",
        "provider: expert bytes fetched, hit rate",
        "-> /metrics, ws stats, /health",
    ],
    color="#f3f4f6",
    edge=GREY,
)
box(
    85,
    24,
    26,
    19,
    "VerifyScheduler + pacer",
    [
        "a drafted block awaits a ticket",
        "budget + carried deficit",
        "in tokens AND expert bytes",
        "first fit + starvation guard",
    ],
    color="#fdf2f2",
    edge=RED,
)
box(
    115.5,
    24,
    26,
    19,
    "lanes (threads)",
    [
        "target lane: prefill, verify",
        "drafter lane: draft, projection",
        "cache copy thread: prefetches",
        "(CUDA: one stream each)",
    ],
    color="#fff7e6",
    edge=ORANGE,
)
box(
    85,
    1,
    26,
    16,
    "Speculator",
    ["Qwen3-MoE target", "DFlash drafter (block B)", "a SpecSession per request"],
    color="#f5eefc",
    edge=PURPLE,
)
box(
    115.5,
    1,
    26,
    16,
    "expert offload",
    ["host store (mmap / pinned)", "byte-budgeted device cache", "(emulated link on CPU)"],
    color="#f5eefc",
    edge=PURPLE,
)

arrow(98, 49.6, 98, 43.4, "register, tick", color=RED, lx=6.5)
arrow(128.5, 49.6, 128.5, 43.4, "await lane.run", lx=-7.5)
arrow(84.6, 52, 72.4, 40, "", color=GREY, ls=":")
arrow(53.5, 43.4, 53.5, 54.6, "", color=GREY, ls=":")
arrow(122, 23.6, 104, 17.4, "forwards", lx=2, ly=1.5)
arrow(132, 23.6, 132, 17.4, "copies", lx=5)
arrow(111.4, 9, 115.1, 9, "", style="<|-|>")
ax.text(
    7,
    20,
    "Lifecycle of a sequence:\nWAITING -> PREFILL -> DRAFT <-> VERIFY -> FINISHED\n"
    "any live state -> ABORTED (cancel, disconnect)\n or FAILED (an error in its own round)",
    fontsize=8.6,
    va="top",
    family="monospace",
    color="#333a48",
)
fig.savefig(
    Path(__file__).resolve().parent.parent / "docs" / "architecture.png", bbox_inches="tight", facecolor="white"
)
print("ok")
