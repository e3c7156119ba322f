#!/usr/bin/env bash
# Installs this tree's pdflash (--no-deps) and the wheels of tools/gpu_wheels.txt whose module the
# interpreter lacks, into SITE (use it with PYTHONPATH=SITE), from .whl/ only: no network, and
# the interpreter's own torch and triton are never replaced. A stage of tools/gpu_check.sh.
#
#   tools/gpu_install.sh SITE        (PYTHON=... chooses the interpreter; default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
site=${1:?usage: tools/gpu_install.sh SITE}
py=${PYTHON:-python3}
mkdir -p "$site"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1  # no network: never ask PyPI
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

missing=$("$py" - tools/gpu_wheels.txt <<'PYEOF'
import importlib.util, sys
for line in open(sys.argv[1]):
    fields = line.split("#")[0].split()  # pin, module[, optional]
    if fields and importlib.util.find_spec(fields[1]) is None:
        print(fields[0] + (",optional" if fields[2:] == ["optional"] else ""))
PYEOF
)
echo "missing:" ${missing:-none}
have_pip=1
"$py" -m pip --version >/dev/null 2>&1 || have_pip=0
wheels=()
if [ -n "$missing" ]; then
  for entry in $missing; do
    pin=${entry%,optional}
    name=${pin%%==*}
    version=${pin#*==}
    # wheel file names use underscores for - and . in the distribution name, in any case
    found=$(find .whl -maxdepth 1 -iname "$(echo "$name" | tr -- '-.' '__')-$version-*.whl" 2>/dev/null | head -1 || true)
    if [ -n "$found" ]; then
      wheels+=("$found")
    elif [ "$entry" != "$pin" ]; then
      echo "optional $pin: no wheel in .whl/, left out"
    else
      echo "no wheel for $pin in .whl/: run tools/gpu_wheels.sh on a machine with network, then carry .whl" >&2
      exit 1
    fi
  done
fi
if [ "${#wheels[@]}" -gt 0 ]; then
  if [ "$have_pip" = 1 ]; then
    "$py" -m pip install --no-index --no-deps --upgrade --target "$site" "${wheels[@]}"
  else  # a wheel is a zip of what goes into site-packages
    "$py" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' "$site" "${wheels[@]}"
  fi
fi
# built from a fresh copy of the sources: setuptools' build/ folder in the tree may hold stale files
source_copy=$(mktemp -d)
trap 'rm -rf "$source_copy"' EXIT
cp -r pyproject.toml README.md src kernels "$source_copy/"
rm -rf "$source_copy"/src/*.egg-info
if [ "$have_pip" = 0 ] ||
  ! "$py" -m pip install --no-index --no-deps --no-build-isolation --upgrade --target "$site" "$source_copy"; then
  # no pip, or no build backend that works: copy what pyproject.toml's package mapping installs
  echo "pip could not install pdflash: copying src/pdflash, with kernels/ as pdflash.kernels"
  rm -rf "$site/pdflash"
  cp -r src/pdflash "$site/pdflash"
  cp -r kernels "$site/pdflash/kernels"
fi
"$py" - "$site" <<'PYEOF'
import pathlib, sys
import pdflash, pdflash.kernels
where = pathlib.Path(pdflash.__file__).resolve()
assert where.is_relative_to(pathlib.Path(sys.argv[1]).resolve()), f"pdflash imports from {where}, not the install"
print(f"pdflash {pdflash.__version__} from {where.parent}")
PYEOF
