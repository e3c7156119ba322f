#!/usr/bin/env bash
# Build llama.cpp from the llama-cpp-python sdist's vendored source and convert the bundled
# target to an F32 GGUF, for benchmarks/bench_llama_cpp.py (docs/compile.md).
#
#   bash benchmarks/llama_cpp_setup.sh [WORKDIR]   (default: ./.llama-cpp; needs cmake, a C++ compiler)
#
# Steps: 1. `pip download --no-binary :all: --no-deps llama-cpp-python` fetches the sdist from the
# package registry; 2. cmake builds llama-bench, llama-completion and llama-simple from its
# vendor/llama.cpp (CPU backend, native ISA, no network features); 3. its convert_hf_to_gguf.py
# writes the bundled target as F32. The converter refuses a BPE pre-tokenizer whose hash it does
# not know; the bundled tokenizer is a byte-level BPE with GPT-2's pre-tokenizer regex, so step 3
# maps it to "gpt-2" by overriding `get_vocab_base_pre` for this one run (no file is edited).
set -euo pipefail
WORK="${1:-.llama-cpp}"
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
PYTHON="${PYTHON:-python}"
TARGET="$("$PYTHON" -c 'from pdflash.bundled import default_target; print(default_target())')"

if ! ls "$WORK"/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
  "$PYTHON" -m pip download --no-binary :all: --no-deps llama-cpp-python -d "$WORK"
fi
SDIST="$(ls "$WORK"/llama_cpp_python-*.tar.gz | head -1)"
SRC="$WORK/$(basename "$SDIST" .tar.gz)"
[ -d "$SRC" ] || tar xzf "$SDIST" -C "$WORK"
LLAMA="$SRC/vendor/llama.cpp"

cmake -S "$LLAMA" -B "$LLAMA/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
cmake --build "$LLAMA/build" -j "$(nproc)" --target llama-bench llama-completion llama-simple

GGUF="$WORK/pdflash-moe-code-f32.gguf"
if [ ! -f "$GGUF" ]; then
  (cd "$LLAMA" && "$PYTHON" - "$TARGET" "$GGUF" <<'PY'
import sys

sys.path.insert(0, ".")
sys.path.insert(1, "gguf-py")
from conversion.base import TextModel  # noqa: E402

TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"  # the bundled BPE uses GPT-2's pre-tokenizer
import convert_hf_to_gguf  # noqa: E402

target, out = sys.argv[1:]
sys.argv = ["convert_hf_to_gguf.py", target, "--outtype", "f32", "--outfile", out]
convert_hf_to_gguf.main()
PY
  )
fi
echo "llama.cpp binaries: $LLAMA/build/bin"
echo "model: $GGUF"
