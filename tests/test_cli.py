"""`pdflash generate`: the --json contract, spec == --no-spec, clear errors."""

import json
import shlex
import shutil
import signal
import subprocess
import sys

import pytest

import pdflash
from pdflash import cli
from pdflash.cli import main
from pdflash.target.tiny import write_tiny_drafter


@pytest.fixture(scope="module")
def drafter_dir(tiny_target, tmp_path_factory):
    return write_tiny_drafter(tmp_path_factory.mktemp("drafter"), tiny_target)


def run_json(capsys, *argv) -> dict:
    assert main(["generate", *argv, "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, "--json prints exactly one line"
    return json.loads(out[0])


def test_json_contract_speculative_equals_no_spec(capsys, tiny_target, drafter_dir):
    common = [
        "--target",
        str(tiny_target),
        "--drafter",
        str(drafter_dir),
        "--prompt",
        "def fib(n):",
        "--max-tokens",
        "24",
    ]
    spec = run_json(capsys, *common, "--block-size", "4")
    plain = run_json(capsys, *common, "--no-spec")
    assert set(spec) == {"token_ids", "text", "acceptance_lengths", "block_sizes", "stats"}
    assert len(spec["block_sizes"]) == len(spec["acceptance_lengths"]) and max(spec["block_sizes"]) <= 4
    fixed = run_json(capsys, *common, "--block-size", "4", "--speculation", "fixed")
    assert fixed["token_ids"] == plain["token_ids"]
    emitted = [1 + sum(fixed["acceptance_lengths"][:i]) for i in range(len(fixed["block_sizes"]))]
    assert fixed["block_sizes"] == [min(4, 24 - e + 1) for e in emitted]  # the whole block, clipped at the end
    assert spec["token_ids"] == plain["token_ids"] and len(spec["token_ids"]) == 24
    shared = run_json(capsys, *common, "--block-size", "4", "--drafter-lane", "shared")
    assert shared["token_ids"] == plain["token_ids"] and shared["stats"]["drafter_lane"] == "shared"
    assert spec["stats"]["drafter_lane"] == "own" and plain["stats"]["drafter_lane"] is None  # 1 thread: its own
    assert spec["stats"]["prefill_mode"] == "verify"  # resident with a drafter: "auto" rides verifies
    assert plain["stats"]["prefill_mode"] == "alone"  # resident plain decoding prefills alone
    asked = run_json(capsys, *common, "--block-size", "4", "--prefill-mode", "alone")
    assert asked["token_ids"] == plain["token_ids"] and asked["stats"]["prefill_mode"] == "alone"
    assert plain["acceptance_lengths"] == [] or set(plain["acceptance_lengths"]) == {1}
    assert sum(spec["acceptance_lengths"]) == 23  # every token after the prefill's first comes from a round
    for key in ("mean_acceptance_length", "tokens_per_second", "projection_coverage", "projection_waste_bytes"):
        assert key in spec["stats"]


def test_prompt_ids_and_sampling_flags(capsys, tiny_target):
    out = run_json(
        capsys,
        "--target",
        str(tiny_target),
        "--prompt-ids",
        "1,2,3",
        "--max-tokens",
        "5",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--top-k",
        "20",
        "--seed",
        "3",
    )
    again = run_json(
        capsys,
        "--target",
        str(tiny_target),
        "--prompt-ids",
        "1,2,3",
        "--max-tokens",
        "5",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--top-k",
        "20",
        "--seed",
        "3",
    )
    assert out["token_ids"] == again["token_ids"] and len(out["token_ids"]) == 5


def test_invalid_sampling_value_is_a_clear_error(capsys, tiny_target):
    assert main(["generate", "--target", str(tiny_target), "--prompt-ids", "1", "--temperature", "-1"]) == 2
    assert "temperature=-1.0 is invalid: it must be a finite number >= 0" in capsys.readouterr().err


def test_missing_target_is_a_clear_error(capsys, tmp_path):
    assert main(["generate", "--target", str(tmp_path / "nope"), "--prompt-ids", "1"]) == cli.EXIT_MODEL
    assert "missing config.json" in capsys.readouterr().err


def test_user_errors_are_one_line_with_distinct_exit_codes(capsys, tiny_target, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_target, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"num_experts": "many"}))
    (tmp_path / "afile").write_text("x")
    cases = [
        (["generate", "--target", str(bad), "--prompt", "x"], cli.EXIT_MODEL, "'num_experts' must be an integer"),
        (["make-tiny", str(tmp_path / "afile")], cli.EXIT_FILE, "is not a directory"),
        (
            ["train-drafter", "--target", str(tiny_target), "--data", "/nonexistent", "--out", str(tmp_path / "d")],
            cli.EXIT_FILE,
            "/nonexistent is not a file",
        ),
        (["generate", "--device", "cuda", "--prompt", "x"], cli.EXIT_DEVICE, "--device cuda is not available"),
    ]
    for argv, code, fragment in cases:
        assert main(argv) == code, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert fragment in err[-1] and "Traceback" not in "".join(err), err
    for argv in (["serve", "--port", "99999"], ["generate", "--block-size", "0", "--prompt", "x"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == cli.EXIT_USAGE


def test_version_broken_pipe_and_trailing_newline(tiny_target):
    version = subprocess.run([sys.executable, "-m", "pdflash.cli", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.strip() == f"pdflash {pdflash.__version__}"
    gen = [sys.executable, "-m", "pdflash.cli", "generate", "--target", str(tiny_target), "--prompt", "ab"]
    whole = subprocess.run([*gen, "--max-tokens", "5"], capture_output=True, text=True)
    assert whole.returncode == 0 and whole.stdout.endswith("\n")
    piped = subprocess.run(
        f"{shlex.join([*gen, '--max-tokens', '400'])} | head -c 1", shell=True, capture_output=True, text=True
    )
    assert "Traceback" not in piped.stderr and "BrokenPipe" not in piped.stderr


def test_offload_flags_keep_tokens_and_report_traffic(capsys, tiny_target, drafter_dir):
    common = ["--target", str(tiny_target), "--drafter", str(drafter_dir), "--prompt", "def f():", "--max-tokens", "12"]
    resident = run_json(capsys, *common)
    offloaded = run_json(
        capsys, *common, "--expert-cache-fraction", "0.25", "--eviction", "lru", "--emulate-link-gbps", "16"
    )
    assert offloaded["token_ids"] == resident["token_ids"]
    stats = offloaded["stats"]
    assert stats["link"] == "emulated" and stats["expert_bytes_fetched"] > 0
    for key in ("expert_cache_peak_bytes", "expert_cache_hit_rate", "exposed_fetch_s"):
        assert key in stats


def test_train_drafter_writes_stats_and_reuses_its_data_cache(capsys, tiny_target, tmp_path, monkeypatch):
    import pdflash.spec.train

    text = tmp_path / "corpus.py"
    text.write_text("def add(a, b):\n    return a + b\n" * 40)
    cache, stats = tmp_path / "data.pt", tmp_path / "stats.json"

    def train(*extra):
        argv = [
            "train-drafter",
            "--target",
            str(tiny_target),
            "--data",
            str(text),
            "--out",
            str(tmp_path / "d"),
            "--steps",
            "3",
            "--sequences",
            "4",
            "--prompt-tokens",
            "8",
            "--response-tokens",
            "12",
            "--anchors",
            "2",
            "--data-cache",
            str(cache),
            "--stats",
            str(stats),
            *extra,
        ]
        assert main(argv) == 0, capsys.readouterr().err

    train()
    figures = json.loads(stats.read_text())
    assert figures["steps"] == 3 and figures["sequences"] == 4 and len(figures["losses"]) == 3
    assert figures["settings"]["anchors_per_sequence"] == 2 and cache.is_file()

    built = []
    real_build = pdflash.spec.train.build_training_data
    monkeypatch.setattr(
        pdflash.spec.train, "build_training_data", lambda *a, **k: built.append(1) or real_build(*a, **k)
    )
    train("--lr", "1e-4")  # a training option only: the cached continuations serve
    assert built == []
    train("--response-tokens", "10")  # a data option: the cache is stale and rebuilt
    assert built == [1]


def test_make_tiny_gpt_oss_then_train_a_drafter_on_it(capsys, tmp_path):
    target = tmp_path / "gpt-oss"
    assert main(["make-tiny", "--family", "gpt-oss", str(target)]) == 0
    config = json.loads((target / "config.json").read_text())
    assert config["model_type"] == "gpt_oss" and config["quantization_config"]["quant_method"] == "mxfp4"
    assert "<|channel|>" in json.loads((target / "tokenizer_config.json").read_text())["chat_template"]
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 30)
    argv = ["train-drafter", "--target", str(target), "--data", str(text), "--out", str(tmp_path / "d")]
    argv += ["--steps", "3", "--sequences", "4", "--prompt-tokens", "8", "--response-tokens", "12", "--anchors", "2"]
    assert main(argv) == 0, capsys.readouterr().err
    from pdflash.spec.drafter import load_drafter
    from pdflash.target.loader import load_target

    drafter = load_drafter(tmp_path / "d", load_target(target).model)
    assert drafter.config.num_target_layers == config["num_hidden_layers"]


def test_ctrl_c_during_generate_is_quiet_with_status_130(tiny_target):
    cmd = [sys.executable, "-m", "pdflash.cli", "generate", "--target", str(tiny_target), "--prompt", "ab"]
    proc = subprocess.Popen([*cmd, "--max-tokens", "2000", "--no-spec"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(1)  # it is generating
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == cli.EXIT_INTERRUPTED and "Traceback" not in err.decode(), err.decode()[-2000:]


def test_serve_flags_become_server_settings(monkeypatch, tiny_target):
    from pdflash.bundled import default_target

    monkeypatch.setenv(cli.API_KEY_ENV, "sk-env")
    argv = ["serve", "--max-model-len", "512", "--max-body-bytes", "1000", "--allowed-origins", "https://a.example"]
    args = cli.build_parser().parse_args(argv)
    cli.engine_options(args)
    settings = cli.server_settings(args)
    assert settings.api_key == "sk-env" and settings.max_model_len == 512 and settings.limits.max_body_bytes == 1000
    assert settings.allowed_origins == ("https://a.example",) and settings.model_name == default_target().name
    assert settings.sampling_defaults == {"temperature": 0.7, "top_p": 0.95}  # the bundled generation_config.json
    greedy = cli.build_parser().parse_args(["serve", "--greedy", "--api-key", "sk-flag", "--target", str(tiny_target)])
    cli.engine_options(greedy)
    assert cli.server_settings(greedy).sampling_defaults == {} and cli.server_settings(greedy).api_key == "sk-flag"
