"""A test double of the model output only, and how agents read streamed tool calls.

`ScriptedSampler` stands in for `sample(logits, params, generator)` (patched into the
speculator), so each sampled token is the next token of a script, then `end`. Everything
else in a served request stays real: forwards, the engine loop, detokenization, templates,
parsers, SSE. Requests run one at a time, without a drafter, so every call is one token.
"""

from collections import deque

import torch


class ScriptedSampler:
    def __init__(self, tokenizer, end: str = "<|endoftext|>") -> None:
        self.tokenizer = tokenizer
        self.eos = tokenizer.token_id(end)
        self.script: deque[int] = deque()

    def say(self, text: str) -> None:
        self.script = deque(self.tokenizer.encode(text))

    def __call__(self, logits, params, generator):
        return torch.tensor([self.script.popleft() if self.script else self.eos for _ in range(logits.shape[0])])


def streamed_calls(chunks):
    """Tool calls accumulated from streamed `openai` chunks by index, as agents do; plus pieces per call."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for d in (chunk.choices[0].delta.tool_calls if chunk.choices else None) or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": "", "pieces": 0})
            call["id"] = d.id or call["id"]
            call["name"] = (d.function.name if d.function else None) or call["name"]
            call["arguments"] += (d.function.arguments or "") if d.function else ""
            call["pieces"] += 1
    return [calls[i] for i in sorted(calls)]
