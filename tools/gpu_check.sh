#!/usr/bin/env bash
# The prepared GPU check: everything a GPU machine should answer, in one run of at most 8 minutes.
#
# Runs on the machine as it comes (Python 3.12 with its own CUDA torch and triton, no network):
# installs this tree's pdflash with --no-deps and the missing pure-Python dependencies from .whl/
# (tools/gpu_wheels.sh fills it beforehand), then runs, each stage under its own timeout so that
# one hang does not eat the rest, writing everything under one folder ($OUT if set, else a new
# temporary one):
#   env            facts: nvidia-smi, Python, torch / triton / CUDA versions, host, measured H2D GB/s
#   install        tools/gpu_install.sh into a work folder outside $OUT
#   cuda-tests     pytest tests/cuda (TRITON_INTERPRET=0: kernels compiled), junit XML
#   bench-cli      `pdflash bench --quick` (resident and offloaded), when the command exists
#   bench-engine   otherwise benchmarks/bench_engine.py: bundled pair, resident and offloaded over
#   bench-offload  the real link, and benchmarks/bench_offload.py: link bytes and exposed fetch time
#   bench-kernels  benchmarks/bench_kernels.py at Qwen3-30B-A3B verify shapes
#   summary        summary.json and summary.md (tools/gpu_summary.py)
# Without CUDA the same stages run with tiny budgets (the CUDA tests skip): the test suite runs it
# so (tests/test_gpu_check.py). Exit status 0 when no stage failed or timed out.
#
#   OUT=/some/dir tools/gpu_check.sh      PYTHON=python3.12  GPU_CHECK_TOTAL_S=480
# A rerun after a fix can pick stages and tests (env and install always run, summary always):
#   GPU_CHECK_ONLY="cuda-tests bench-engine"  GPU_CHECK_PYTEST_ARGS="-k offload"
set -uo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
py=${PYTHON:-}
if [ -z "$py" ]; then  # the first interpreter that has torch: the machine's own
  for candidate in python3 python3.12 python; do
    if "$candidate" -c "import torch" >/dev/null 2>&1; then
      py=$candidate
      break
    fi
  done
  py=${py:-python3}
fi
total_s=${GPU_CHECK_TOTAL_S:-480}
reserve_s=15  # kept for the summary
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/pdflash-gpu-check.XXXXXX")}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [ -n "${GPU_CHECK_WORK:-}" ]; then
  work=$GPU_CHECK_WORK  # installs go here, not under $OUT (which is sent back)
else
  work=$(mktemp -d "${TMPDIR:-/tmp}/pdflash-gpu-work.XXXXXX")
  trap 'rm -rf "$work"' EXIT
fi
site=$work/site
stages=$OUT/stages.jsonl
: >"$stages"
target=src/pdflash/models/pdflash-moe-code
drafter=src/pdflash/models/pdflash-moe-code-dflash
export TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if ! mkdir -p "${HOME:-/nonexistent}/.triton/cache" 2>/dev/null; then
  export TRITON_CACHE_DIR=$work/triton-cache  # triton compiles into its cache: somewhere writable
fi

record() {  # record STAGE STATUS RC SECONDS NOTE: one JSON line in stages.jsonl
  "$py" -c 'import json, sys; n, s, rc, sec, note = sys.argv[1:]
print(json.dumps(dict(stage=n, status=s, rc=int(rc), seconds=int(sec), note=note, log=n + ".log")))' "$@" >>"$stages"
  printf '%-14s %-8s %4ss  %s\n' "$1" "$2" "$4" "$5"
}

stage() {  # stage NAME BUDGET_S CMD...: CMD under its own timeout (and the total's), logged to NAME.log
  local name=$1 budget=$2
  shift 2
  if ! selected "$name"; then
    record "$name" skipped 0 0 "not in GPU_CHECK_ONLY"
    return 1
  fi
  local left=$((total_s - (SECONDS - started) - reserve_s))
  if ((left < 5)); then
    record "$name" no-time 0 0 "no time left of the ${total_s}s total"
    return 1
  fi
  local limit=$((budget < left ? budget : left)) t0=$SECONDS status
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  case $rc in
    0) status=pass ;;
    124 | 137) status=timeout ;;
    *) status=fail ;;
  esac
  record "$name" "$status" "$rc" $((SECONDS - t0)) "limit ${limit}s: $*"
  [ "$rc" = 0 ]
}

skip() {  # skip NAME WHY
  if selected "$1"; then
    record "$1" skipped 0 0 "$2"
  else
    record "$1" skipped 0 0 "not in GPU_CHECK_ONLY"
  fi
}

selected() {  # selected NAME: env and install always; the others if GPU_CHECK_ONLY is unset or names them
  case " env install ${GPU_CHECK_ONLY:-$1} " in
    *" $1 "*) return 0 ;;
    *) return 1 ;;
  esac
}

echo "pdflash GPU check: output in $OUT"
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  record env fail 1 0 "$py cannot import torch: this check uses the machine's own torch (set PYTHON)"
  "$py" tools/gpu_summary.py "$OUT"
  exit 1
fi
cuda=$("$py" -c "import torch; print(int(torch.cuda.is_available()))")
command -v nvidia-smi >/dev/null && timeout 30 nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1

stage env 60 "$py" tools/gpu_facts.py "$OUT/env.json"
if stage install 90 env PYTHON="$py" bash tools/gpu_install.sh "$site"; then
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "install failed: the later stages use whatever pdflash $py imports" >&2
fi

if [ "$cuda" = 1 ]; then
  # shellcheck disable=SC2086  # GPU_CHECK_PYTEST_ARGS is a list of words
  stage cuda-tests 270 "$py" -m pytest tests/cuda -m cuda -p no:cacheprovider -v -rfEs --durations=15 \
    --junitxml="$OUT/cuda-tests.xml" ${GPU_CHECK_PYTEST_ARGS:-}
  stage bench-kernels 90 "$py" benchmarks/bench_kernels.py --tokens 8 64 256 512 --json "$OUT/bench-kernels.json"
else  # collected and skipped here: imports and markers still checked
  stage cuda-tests 60 "$py" -m pytest tests/cuda -m cuda -p no:cacheprovider -q -rfEs \
    --junitxml="$OUT/cuda-tests.xml"
  stage bench-kernels 30 "$py" benchmarks/bench_kernels.py --experts 16 --top-k 4 --hidden 64 --intermediate 32 \
    --tokens 8 --dtype fp32 --warmup 1 --repeats 2 --threads 1 --json "$OUT/bench-kernels.json"
fi

bench_help=$OUT/bench-cli-help.txt
if [ "$cuda" = 0 ]; then
  skip bench-cli "no CUDA: pdflash bench --quick takes minutes on a CPU; its own tests cover it"
elif ! selected bench-cli; then
  skip bench-cli "not selected"
elif ! timeout 60 "$py" -m pdflash.cli bench --help >"$bench_help" 2>&1; then
  skip bench-cli "pdflash has no bench command yet (pdflash bench --help failed): benchmark scripts instead"
elif ! grep -q -- "--device" "$bench_help"; then
  skip bench-cli "pdflash bench has no --device option, so it would run on the CPU: benchmark scripts instead"
elif stage bench-cli 240 "$py" -m pdflash.cli bench --quick --device cuda --json "$OUT/bench.json"; then
  benched=1
fi

if [ "${benched:-0}" = 1 ]; then
  skip bench-engine "pdflash bench ran"
  skip bench-offload "pdflash bench ran"
elif [ "$cuda" = 1 ]; then
  skip bench-engine "benchmarks/bench_engine.py became pdflash bench"
  stage bench-offload 90 "$py" benchmarks/bench_offload.py --device cuda --target "$target" --drafter "$drafter" \
    --prompts 2 --max-tokens 32 --json "$OUT/bench-offload.json"
else
  skip bench-engine "benchmarks/bench_engine.py became pdflash bench (tests/bench covers it on the CPU)"
  stage bench-offload 60 "$py" benchmarks/bench_offload.py --prompts 1 --prompt-len 8 --max-tokens 4 \
    --json "$OUT/bench-offload.json"
fi

"$py" tools/gpu_summary.py "$OUT"
status=$?
echo "total $((SECONDS - started))s; summary: $OUT/summary.md"
exit $status
