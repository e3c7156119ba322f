#!/usr/bin/env bash
# Downloads, on a machine with network, every wheel tools/gpu_wheels.txt lists, for the GPU
# machine's Python 3.12 on x86-64 Linux, into .whl/ (git-ignored; the device tool carries it).
#
#   tools/gpu_wheels.sh            # then: run(command="tools/gpu_check.sh", carry=[".whl"])
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t pins < <(grep -v '^#' tools/gpu_wheels.txt | awk 'NF { print $1 }')
mkdir -p .whl
set -x
python -m pip download --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${pins[@]}"
