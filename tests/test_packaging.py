"""How pdflash installs: `kernels/` lives at the repository's top level but installs as `pdflash.kernels`,
so Hugging Face's PyPI `kernels` package (which transformers imports) is never shadowed."""

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str, cwd: Path, env: dict | None = None) -> str:
    # -P: the current directory is not put on sys.path, as for any installed program
    done = subprocess.run(
        [sys.executable, "-P", "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_pypi_kernels_and_pdflash_kernels_import_side_by_side(tmp_path):
    out = run_python(
        "import kernels, pdflash.kernels\n"
        "print(kernels.__file__)\n"
        "print(callable(getattr(kernels, 'get_kernel', None)), callable(pdflash.kernels.grouped_swiglu))\n",
        cwd=tmp_path,
    )
    hf_file, flags = out.splitlines()
    assert "site-packages" in hf_file and not hf_file.startswith(str(REPO / "kernels"))
    assert flags == "True True"  # each name is the package it should be


def test_the_wheel_ships_pdflash_kernels_and_no_top_level_kernels(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(REPO), "-w", tmp_path],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("pdflash-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "pdflash/kernels/__init__.py" in names and "pdflash/kernels/triton_swiglu.py" in names
    assert not [n for n in names if n.startswith("kernels/")]
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, wheel],
        check=True,
        capture_output=True,
        timeout=300,
    )
    out = run_python(
        "import pdflash, pdflash.kernels, pdflash.engine.async_engine\n"
        "print(pdflash.__file__); print(pdflash.kernels.__file__)\n",
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
    )
    assert all(line.startswith(str(site)) for line in out.splitlines())  # the wheel's copy, not the checkout
