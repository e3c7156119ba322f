"""`pdflash serve`'s replica flags without Ray: the one-engine path never imports Ray, and the
replica-only flags are refused without --replicas."""

import subprocess
import sys

import pytest

from pdflash.cli import main

NO_RAY_SERVE = """
import sys
from pdflash.server.shutdown import GracefulServer
GracefulServer.run = lambda self, sockets=None: print("app built:", type(self.config.app).__name__)
from pdflash.cli import main
assert main(["serve", "--target", sys.argv[1], "--port", "0"]) == 0
print("ray imported:", "ray" in sys.modules, "ray.serve imported:", "ray.serve" in sys.modules)
"""


def test_serve_without_replicas_builds_its_app_without_importing_ray(tiny_target):
    result = subprocess.run(
        [sys.executable, "-c", NO_RAY_SERVE, str(tiny_target)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "app built: Starlette" in result.stdout
    assert "ray imported: False ray.serve imported: False" in result.stdout


@pytest.mark.parametrize(
    "flags",
    [["--ray-address", "auto"], ["--gpus-per-replica", "1"], ["--cpus-per-replica", "2"], ["--session-field", "user"]],
)
def test_replica_flags_without_replicas_are_refused_by_name(tiny_target, flags, capsys):
    assert main(["serve", "--target", str(tiny_target), "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert f"{flags[0]} goes with --replicas N" in err


def test_replicas_must_be_a_positive_integer(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--replicas", "0"])
    assert exit_.value.code == 2 and "--replicas: must be an integer >= 1, got 0" in capsys.readouterr().err


WITHOUT_RAY = """
import sys
sys.modules["ray"] = None  # as if the ray extra were not installed
from pdflash.cli import main
sys.exit(main(["serve", "--target", sys.argv[1], "--port", "0", "--replicas", "2"]))
"""


def test_replicas_without_the_ray_extra_say_how_to_install_it(tiny_target):
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_RAY, str(tiny_target)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "--replicas needs Ray Serve, which is not installed: pip install -e '.[ray]'" in result.stderr
