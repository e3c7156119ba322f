"""Text ↔ token ids through the `tokenizers` library, and the chat template (jinja2)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2.sandbox
from tokenizers import Tokenizer

from pdflash.errors import CheckpointError


class TextTokenizer:
    """A checkpoint's `tokenizer.json` plus the chat template of its `tokenizer_config.json`."""

    def __init__(self, directory: Path, vocab_size: int) -> None:
        path = directory / "tokenizer.json"
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for unreadable files
            raise CheckpointError(f"{path}: cannot load tokenizer ({exc})") from exc
        size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        if size > vocab_size:
            raise CheckpointError(f"{path}: tokenizer has {size} tokens but the model's vocab_size is {vocab_size}")
        self.chat_template, self.special = _chat_settings(directory / "tokenizer_config.json")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("this model's tokenizer_config.json has no chat_template; use a plain completion")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now  # the harmony (gpt-oss) template dates its system header
        template = env.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)


def _raise(message: str) -> None:
    raise ValueError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _chat_settings(path: Path) -> tuple[str | None, dict[str, str]]:
    if not path.is_file():
        return None, {}
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    template = raw.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    special = {
        key: (value["content"] if isinstance(value, dict) else value)
        for key in ("bos_token", "eos_token", "pad_token")
        if (value := raw.get(key)) is not None
    }
    return template, special
