"""pdflash (eager and compiled steps, AR and DFlash) vs llama.cpp F32 on the bundled model, side by side.

Run `bash benchmarks/llama_cpp_setup.sh WORK` first (builds llama.cpp from the llama-cpp-python
sdist, converts the bundled target to F32 GGUF), then

    python benchmarks/bench_llama_cpp.py --llama WORK [--threads 1 2] [--tokens 64] [--prompts 4]

For every thread count and HumanEval prompt it runs, interleaved: llama.cpp's greedy decoding
(llama-completion, its own eval timing, prefill excluded), pdflash AR and DFlash eager, then the
same with the compiled steps of each step backend (`--backends`: AOTInductor packages and
torch.compile, docs/compile.md); pdflash decode rates exclude the prefill too. Prints medians,
the ratios, the compile warm-up, and whether the greedy texts agree. One process, one machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch

EVAL = re.compile(r"\beval time =\s+([\d.]+) ms /\s+(\d+) runs")


def llama_cpp(binary: Path, gguf: Path, prompt: str, tokens: int, threads: int) -> tuple[float, str]:
    """Greedy decode with llama-completion: (eval tokens/s, generated text)."""
    out = subprocess.run(
        [str(binary), "-m", str(gguf), "-p", prompt, "-n", str(tokens), "--temp", "0", "-t", str(threads),
         "-tb", str(threads), "-no-cnv", "--ignore-eos", "--no-warmup", "--no-display-prompt", "-c", "2048"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    match = EVAL.search(out.stderr)
    if match is None:
        raise RuntimeError(f"no eval timing in llama-completion's output:\n{out.stderr[-2000:]}")
    ms, runs = float(match.group(1)), int(match.group(2))
    return runs / ms * 1e3, out.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama", type=Path, required=True, help="the WORK directory of llama_cpp_setup.sh")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per run")
    parser.add_argument("--prompts", type=int, default=4, help="HumanEval prompts")
    parser.add_argument("--max-batch", type=int, default=1, help="batch buckets compiled (up to this many sequences)")
    parser.add_argument(
        "--backends", nargs="+", default=["aot", "inductor"], choices=["aot", "inductor"], help="step backends compared"
    )
    args = parser.parse_args()

    from pdflash.bench.workload import humaneval_prompts
    from pdflash.bundled import BUNDLED_DRAFTER, BUNDLED_TARGET
    from pdflash.sampling import SamplingParams
    from pdflash.spec.drafter import load_drafter
    from pdflash.spec.speculator import Speculator, speculative_generate
    from pdflash.spec.step_install import install_steps
    from pdflash.target.compiled import BACKEND_ENV
    from pdflash.target.loader import load_target

    binary = next(args.llama.glob("llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-completion"))
    gguf = args.llama / "pdflash-moe-code-f32.gguf"
    loaded = load_target(BUNDLED_TARGET)
    assert loaded.tokenizer is not None  # the bundled target ships its tokenizer
    drafter = load_drafter(BUNDLED_DRAFTER, loaded.model)
    specs = {
        "ar": Speculator(loaded.model, None, expert_nbytes=loaded.expert_nbytes, projector="last-union"),
        "dflash": Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes, projector="last-union"),
    }
    prompts = humaneval_prompts(args.prompts)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.0)
    warm_up_s: dict[tuple[int, str], float] = {}

    def run(name: str, steps: tuple, prompt_ids: list[int]) -> tuple[float, tuple[int, ...]]:
        loaded.model.steps, drafter.steps = steps
        result = speculative_generate(specs[name], prompt_ids, params)
        return result.stats["tokens_per_second"], result.token_ids

    rates: dict[tuple[int, str], list[float]] = {}
    agree = {"llama.cpp = pdflash AR": 0} | {f"{b} = eager ({n})": 0 for b in args.backends for n in ("AR", "DFlash")}
    for threads in args.threads:  # compiled kernels are built per thread count: warm up at each
        torch.set_num_threads(threads)
        steps = {"eager": (None, None)}
        for backend in args.backends:
            os.environ[BACKEND_ENV] = backend
            started = time.perf_counter()
            install_steps(specs["dflash"], max_batch=args.max_batch, threads=(threads, threads), progress=True)
            warm_up_s[threads, backend] = time.perf_counter() - started
            steps[backend] = (loaded.model.steps, drafter.steps)
        for prompt in prompts:
            ids = loaded.tokenizer.encode(prompt)
            rate, text = llama_cpp(binary, gguf, prompt, args.tokens, threads)
            rates.setdefault((threads, "llama.cpp"), []).append(rate)
            outputs = {}
            for name in ("ar", "dflash"):
                for backend, pair in steps.items():
                    rate, outputs[name, backend] = run(name, pair, ids)
                    rates.setdefault((threads, f"{name} {backend}"), []).append(rate)
            ar_text = loaded.tokenizer.decode(list(outputs["ar", "eager"]))
            agree["llama.cpp = pdflash AR"] += text.startswith(ar_text[: len(text)]) or ar_text.startswith(text)
            for backend in args.backends:
                agree[f"{backend} = eager (AR)"] += outputs["ar", backend] == outputs["ar", "eager"]
                agree[f"{backend} = eager (DFlash)"] += outputs["dflash", backend] == outputs["dflash", "eager"]

    load = os.getloadavg()
    print(
        f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPU cores, torch "
        f"{torch.__version__}, load average {load[0]:.1f} (shared with other jobs: figures are noisy)"
    )
    print(f"bundled pair, {len(prompts)} HumanEval prompts, {args.tokens} greedy tokens (EOS ignored)")
    print(
        "compile warm-up (target + drafter, every bucket): "
        + ", ".join(f"{b} at {t} thread(s) {s:.1f} s" for (t, b), s in warm_up_s.items())
    )
    for threads in args.threads:
        med = {name: statistics.median(r) for (t, name), r in rates.items() if t == threads}
        print(f"\n{threads} thread(s): decode tokens/s, median over prompts [min-max]")
        for name in med:
            r = rates[threads, name]
            print(f"  {name:16s} {med[name]:8.1f}  [{min(r):.1f}-{max(r):.1f}]")
        base = med["llama.cpp"]
        ratios = {}
        for backend in ["eager", *args.backends]:
            ratios[f"AR {backend} / llama.cpp"] = med[f"ar {backend}"] / base
            ratios[f"DFlash {backend} / llama.cpp"] = med[f"dflash {backend}"] / base
        for backend in args.backends:
            ratios[f"AR {backend} / AR eager"] = med[f"ar {backend}"] / med["ar eager"]
            ratios[f"DFlash {backend} / DFlash eager"] = med[f"dflash {backend}"] / med["dflash eager"]
            ratios[f"DFlash / AR ({backend})"] = med[f"dflash {backend}"] / med[f"ar {backend}"]
        if len(args.backends) == 2:
            for name, label in (("ar", "AR"), ("dflash", "DFlash")):
                ratios[f"{label} {' / '.join(args.backends)}"] = (
                    med[f"{name} {args.backends[0]}"] / med[f"{name} {args.backends[1]}"]
                )
        for label, value in ratios.items():  # goals: AR >= 0.5x llama.cpp at 1 thread, DFlash > 1x
            print(f"  {label:34s} {value:5.2f}x")
    runs = len(prompts) * len(args.threads)
    print("\ngreedy agreement over " + f"{runs} runs: " + ", ".join(f"{k} {v}/{runs}" for k, v in agree.items()))


if __name__ == "__main__":
    main()
