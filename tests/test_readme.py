"""The README's set-up lines keep the contract `.ci/run` relies on, and its Python snippet runs as written."""

import re
import subprocess
import sys
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_setup_is_one_install_line_and_one_test_line():
    install = [line for line in README.splitlines() if "# install" in line]
    test = [line for line in README.splitlines() if "# test" in line]
    assert install and test
    assert "pip install -e ." in install[0] and "pdflash generate" in install[0]
    assert 'pip install -e ".[test]"' in test[0] and "dflash==" in test[0] and "python -m pytest" in test[0]


def test_python_snippet_runs_as_written():
    snippet = re.search(r"## Python API\n\n```python\n(.*?)```", README, re.S).group(1)
    snippet = snippet.replace("max_tokens=64", "max_tokens=8")  # the same code, a shorter answer
    done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.endswith("\n") and done.stdout.strip()
