"""Serving chat with scripted model output: a test double of the sampler, and reading the replies.

`ScriptedSampler` stands in for `sample(logits, params, generator)` (patched into the
speculator), so each sampled token is the next token of a script, then `end`. Everything
else in a served request stays real: forwards, the engine loop, detokenization, templates,
parsers, SSE. Requests run one at a time, without a drafter, so every call is one token.
The rest read what came back as agents do (tool calls assembled by index), and spy on the
prompts the engine was asked to continue.
"""

import json
from collections import deque

import torch

WEATHER = {  # the tool the scripted turns call
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


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


def record_prompts(engine) -> list[str]:
    """A spy on `engine.generate`: the prompts (as text) it is asked to continue; it changes nothing."""
    prompts: list[str] = []
    generate = engine.generate

    def recording_generate(prompt, *args, **kwargs):
        prompts.append(engine.tokenizer.decode(prompt) if isinstance(prompt, list) else prompt)
        return generate(prompt, *args, **kwargs)

    engine.generate = recording_generate
    return prompts


def reply_parts(response, stream: bool):
    """(content, [(name, arguments)], finish_reason) of a chat response, whole or its streamed chunks."""
    if stream:
        chunks = list(response)
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls = [(c["name"], c["arguments"]) for c in streamed_calls(chunks)]
        return content, calls, chunks[-1].choices[0].finish_reason
    choice = response.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return choice.message.content, calls, choice.finish_reason


def ws_generation(url: str, start: dict) -> tuple[list[dict], dict]:
    """Send one websocket `start` message; the deltas of that generation and its `done` (or error)."""
    from websockets.sync.client import connect

    with connect(url) as ws:
        ws.send(json.dumps(start))
        deltas, done = [], None
        while done is None:
            msg = json.loads(ws.recv())
            if msg["type"] == "delta" and msg["id"] == start["id"]:
                deltas.append(msg["delta"])
            elif msg["type"] in ("done", "error"):
                done = msg
    return deltas, done
