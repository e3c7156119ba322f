"""Where a compiled step's time goes on the bundled model: sections of an AR round, then operators.

    python benchmarks/profile_steps.py [--threads 1] [--steps 200]

Part 1 times one AR round (draft_round + verify_round, no drafter) in nested sections: the
compiled graph call (an AOTInductor package's run, or with PDFLASH_STEP_BACKEND=inductor
dynamo's guards, the AOT wrappers and inductor's kernels), the target's forward around it (bucket
padding, K/V moves), and the round (the speculator's bookkeeping and the greedy choice). Part 2
profiles the compiled decode (1 token) and verify (block) steps with torch.profiler, inductor's
kernels named (steps built apart with kernel profiling on, which part 1 leaves off), and lists
the operators by self time. Part 3 times one
matmul against the head weight after a 64 MiB cache flush, in both layouts the steps could take.
Medians over many steps; the machine is shared, so read the proportions, not the rates.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _timed(record: list[float], fn):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        out = fn(*args, **kwargs)
        record.append(time.perf_counter() - started)
        return out

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200, help="decode rounds timed in part 1")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from torch.profiler import ProfilerActivity, profile

    from pdflash.bundled import BUNDLED_TARGET
    from pdflash.sampling import SamplingParams
    from pdflash.spec.speculator import Speculator
    from pdflash.target.compiled import StepBuckets, TargetSteps, step_backend, transposed
    from pdflash.target.loader import load_target

    loaded = load_target(BUNDLED_TARGET)
    model = loaded.model
    speculator = Speculator(model, None, expert_nbytes=loaded.expert_nbytes, projector="last-union")
    steps = TargetSteps(model, StepBuckets(batch=(1,), tokens=(1, 8)))
    model.steps = steps
    print(f"warm-up (decode and verify, batch 1): {steps.warm_up(model.new_cache):.1f} s")

    sections: dict[str, list[float]] = {"graph call": [], "target forward": [], "round": []}
    steps._whole = _timed(sections["graph call"], steps._whole)  # type: ignore[method-assign]
    forward = model.forward
    model.forward = _timed(sections["target forward"], forward)  # type: ignore[method-assign]
    session = speculator.begin_session(list(range(1, 100)), SamplingParams(max_tokens=args.steps, ignore_eos=True))
    for values in sections.values():
        values.clear()  # the prefill is eager and not a round
    while not session.finished:
        started = time.perf_counter()
        speculator.draft_round(session)
        speculator.verify_round(session)
        sections["round"].append(time.perf_counter() - started)
    speculator.release(session)
    model.forward = forward  # type: ignore[method-assign]
    backend = step_backend(model.device)
    print(
        f"\npart 1: one AR decode round, {backend} steps, {args.threads} thread(s), median ms over {args.steps} rounds"
    )
    for name, values in sections.items():
        print(f"  {name:16s} {statistics.median(values) * 1e3:6.3f}  (min {min(values) * 1e3:.3f})")

    torch._inductor.config.cpp.enable_kernel_profile = True  # inductor's kernels by name in part 2
    torch._dynamo.reset()  # torch.compile builds them again, with it (AOT packages are keyed on it)
    model.steps = TargetSteps(model, StepBuckets(batch=(1,), tokens=(1, 8)))
    print(f"\nwarm-up with kernel profiling: {model.steps.warm_up(model.new_cache):.1f} s")
    cache = model.new_cache()
    model.forward([torch.arange(150) % 4000 + 1], [cache])  # a 150-token past
    for tokens in (1, 8):
        block = torch.arange(tokens) + 5
        for _ in range(5):
            model.forward([block], [cache], commit=False)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(50):
                model.forward([block], [cache], commit=False)
        print(f"\npart 2: compiled step of {tokens} token(s) over a 150-token past, 50 steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))

    flush = torch.zeros(16 * 2**20)  # 64 MiB, twice the L3
    head, x = model.lm_head, torch.randn(1, model.config.hidden_size)
    head_t = transposed(head)
    print("part 3: one-token head matmul after a cache flush, median us over 60")
    for name, fn in (("x @ W.t() (view)", lambda: x @ head.t()), ("x @ W_t (copy)", lambda: x @ head_t)):
        times = []
        for _ in range(60):
            flush.add_(1.0)
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        print(f"  {name:18s} {statistics.median(times) * 1e6:7.0f}")


if __name__ == "__main__":
    main()
