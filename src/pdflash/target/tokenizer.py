"""Text ↔ token ids through the `tokenizers` library, plus the checkpoint's chat template.

Owns loading `tokenizer.json` and the ids of its special tokens. The chat template itself
(its environment and rendering) lives in `pdflash.chat.template`.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from pdflash.chat.template import ChatTemplate
from pdflash.errors import CheckpointError


class TextTokenizer:
    """A checkpoint's `tokenizer.json` plus the chat template it ships (None if it has none)."""

    def __init__(self, directory: Path, vocab_size: int) -> None:
        path = directory / "tokenizer.json"
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for unreadable files
            raise CheckpointError(f"{path}: cannot load tokenizer ({exc})") from exc
        size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        if size > vocab_size:
            raise CheckpointError(f"{path}: tokenizer has {size} tokens but the model's vocab_size is {vocab_size}")
        self.chat_template = ChatTemplate.from_checkpoint(directory)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def special_tokens(self) -> dict[int, str]:
        """id -> text of the added tokens marked special (end-of-turn markers and the like)."""
        return {i: t.content for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}
