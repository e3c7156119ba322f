"""Micro-benchmark of chat output parsing: the cost per streamed delta of splitting a turn
into reasoning, content and tool calls, side by side with passing the text through.

Each turn is ~4,000 characters fed in 3-character deltas (about one token each): a
plain answer, a Qwen3 think-then-answer, a think-then-tool-call whose arguments stream
(the canonical hermes form), and the same call in a non-canonical key order (judged
when the block closes).

    PYTHONPATH=src python benchmarks/bench_chat_parsers.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from pdflash.chat.deltas import PlainOutput
from pdflash.chat.families import QWEN3, TurnSetup

DELTA_CHARS = 3
ANSWER = "The function walks the list once and keeps a running total. " * 66
CODE = {
    "path": "src/app.py",
    "content": "def total(xs):\n    s = 0\n    for x in xs:\n        s += x\n    return s\n" * 50,
}
CALL = json.dumps({"name": "write_file", "arguments": CODE})
REORDERED = json.dumps({"arguments": CODE, "name": "write_file"})
TURNS = {
    "plain answer": (ANSWER, None),
    "think + answer": ("<think>\n" + ANSWER[:1000] + "\n</think>\n\n" + ANSWER[1000:], None),
    "think + streamed call": ("<think>\nWrite it.\n</think>\n\n<tool_call>\n" + CALL + "\n</tool_call>", "qwen3"),
    "think + reordered call": ("<think>\nWrite it.\n</think>\n\n<tool_call>\n" + REORDERED + "\n</tool_call>", "qwen3"),
}


def parse_seconds(text: str, family: str | None, *, baseline: bool) -> float:
    chunks = [text[i : i + DELTA_CHARS] for i in range(0, len(text), DELTA_CHARS)]
    if baseline:
        parser = PlainOutput()
    else:
        tools = frozenset({"write_file"}) if family else None
        parser = QWEN3.new_parser(TurnSetup(prompt="<|im_start|>assistant\n", tool_names=tools))
    start = time.perf_counter()
    for chunk in chunks:
        parser.feed(chunk, ())
    parser.finish()
    return (time.perf_counter() - start) / len(chunks)


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--repeats", type=int, default=20)
    repeats = args.parse_args().repeats
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    )
    print(f"{'turn':<24} {'chars':>6} {'plain us/delta':>15} {'qwen3 us/delta':>15} {'ratio':>7}")
    for name, (text, family) in TURNS.items():
        plain = statistics.median(parse_seconds(text, family, baseline=True) for _ in range(repeats)) * 1e6
        qwen3 = statistics.median(parse_seconds(text, family, baseline=False) for _ in range(repeats)) * 1e6
        print(f"{name:<24} {len(text):>6} {plain:>15.2f} {qwen3:>15.2f} {qwen3 / plain:>6.1f}x")


if __name__ == "__main__":
    main()
