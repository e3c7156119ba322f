"""generation_config.json: the sampling defaults a checkpoint ships, and clear errors for bad ones."""

import json

import pytest

from pdflash.bundled import default_target
from pdflash.errors import CheckpointError
from pdflash.target.generation_config import generation_defaults


def test_the_bundled_model_ships_sampling_defaults():
    assert generation_defaults(default_target()) == {"temperature": 0.7, "top_p": 0.95}


def test_fields_read_do_sample_false_is_greedy_and_no_file_is_no_defaults(tmp_path):
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1, "max_length": 9, "do_sample": False})
    )
    assert generation_defaults(tmp_path) == {"temperature": 0.0, "top_k": 20, "repetition_penalty": 1.1}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"top_p": 3}', r"top_p=3 is invalid: it must be a finite number > 0 and <= 1"),
    ],
)
def test_a_bad_file_names_itself_and_the_field(tmp_path, content, message):
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(CheckpointError, match=rf"generation_config.json: .*{message}"):
        generation_defaults(tmp_path)
