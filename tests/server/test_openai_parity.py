"""The OpenAI surface through the official client, checked against the target model itself:
logprobs are its log-softmax at the emitted tokens (speculative and plain decoding agree),
n choices, penalties against their closed form, /tokenize round trips."""

import json

import httpx
import openai
import pytest
import torch
from websockets.sync.client import connect

from pdflash.engine.async_engine import AsyncEngine
from pdflash.server import BackgroundServer, ServerSettings, create_app
from pdflash.target.loader import load_target
from pdflash.target.tiny import write_tiny_drafter

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_target(tiny_target)


@pytest.fixture(scope="module", params=["spec", "plain"])
def client(request, tiny_target, tmp_path_factory):
    drafter = write_tiny_drafter(tmp_path_factory.mktemp("drafter"), tiny_target) if request.param == "spec" else None
    engine = AsyncEngine.from_pretrained(tiny_target, drafter, block_size=4 if drafter else None, max_num_seqs=8)
    with BackgroundServer(create_app(engine, ServerSettings(model_name="tiny"))) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60), server


def next_logits(target, ids: list[int]) -> torch.Tensor:
    """[V] the target's logits after `ids`, one plain forward (the oracle)."""
    out = target.model.forward([torch.tensor(ids)], [target.model.new_cache()], last_logits_only=True)
    return out.logits[0].float()


def test_logprobs_are_the_targets_log_softmax_at_the_emitted_tokens(client, target):
    client, server = client
    ids = target.tokenizer.encode(PROMPT)
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=12, logprobs=3, temperature=0)
    token_ids, logprobs = _ws_ids(server, ids, 12, {"logprobs": 3}, with_logprobs=True)
    assert r.choices[0].logprobs.token_logprobs == pytest.approx([lp["logprob"] for lp in logprobs], abs=1e-5)
    history = list(ids)
    for token, lp in zip(token_ids, logprobs, strict=True):
        oracle = torch.log_softmax(next_logits(target, history), dim=-1)  # [V]
        assert lp["token_id"] == token and lp["logprob"] == pytest.approx(oracle[token].item(), abs=1e-4)
        top = oracle.topk(3)
        assert [t for t, _ in lp["top"]] == top.indices.tolist()
        assert [v for _, v in lp["top"]] == pytest.approx(top.values.tolist(), abs=1e-4)
        history.append(token)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_n_returns_that_many_choices(client):
    client, _ = client
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, n=3, temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 15
    again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, n=3, temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


@pytest.mark.parametrize(
    "penalties",
    [{"frequency_penalty": 1.5}, {"presence_penalty": 2.0}, {"repetition_penalty": 3.0}, {"frequency_penalty": -1.0}],
)
def test_penalties_follow_their_closed_form(client, target, penalties):
    """Greedy with a penalty = argmax of the oracle's logits with the penalty written out by hand."""
    client, server = client
    ids = target.tokenizer.encode(PROMPT)
    got = _ws_ids(server, ids, 10, penalties)
    history, expected = list(ids), []
    f, p, rp = (
        penalties.get("frequency_penalty", 0),
        penalties.get("presence_penalty", 0),
        penalties.get("repetition_penalty", 1),
    )
    for _ in range(10):
        logits = next_logits(target, history).tolist()
        for token in set(history):
            count = expected.count(token)
            if rp != 1:
                logits[token] = logits[token] / rp if logits[token] > 0 else logits[token] * rp
            logits[token] -= f * count + (p if count else 0)
        token = max(range(len(logits)), key=logits.__getitem__)
        expected.append(token)
        history.append(token)
        if token in target.model.config.eos_token_ids:
            break
    assert got == expected
    assert got != _ws_ids(server, ids, 10, {})  # the penalty changed this output


def _ws_ids(server, ids, n, params, with_logprobs=False):
    """Greedy token ids (and logprobs) of one websocket generation."""
    with connect(server.ws_url) as ws:
        start = {"type": "start", "id": 1, "prompt": ids, "params": {"max_tokens": n, "temperature": 0, **params}}
        ws.send(json.dumps(start))
        tokens, logprobs = [], []
        while (m := json.loads(ws.recv(timeout=30)))["type"] != "done":
            tokens += m.get("token_ids", [])
            logprobs += m.get("logprobs", [])
    return (tokens, logprobs) if with_logprobs else tokens


def test_min_tokens_holds_off_a_stop_token(client, target):
    _, server = client
    ids = target.tokenizer.encode(PROMPT)
    first = _ws_ids(server, ids, 1, {})[0]  # the greedy first token, made a stop token below
    assert _ws_ids(server, ids, 8, {"stop_token_ids": [first]}) == [first]
    held = _ws_ids(server, ids, 8, {"stop_token_ids": [first], "min_tokens": 5})
    assert len(held) >= 5 and first not in held[:5]


def test_tokenize_round_trips_and_version(client, target):
    _, server = client
    text = "def add(a, b):\n    return a + b  # ünïcode"
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()
    assert tokens["tokens"] == target.tokenizer.encode(text) and tokens["count"] == len(tokens["tokens"])
    back = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back["prompt"] == text
    assert httpx.get(server.url + "/version").json()["version"]


def test_request_defaults_come_from_the_settings_when_a_request_omits_them(tiny_target):
    """What `pdflash serve` reads from generation_config.json fills the fields a request leaves out."""
    engine = AsyncEngine.from_pretrained(tiny_target)
    settings = ServerSettings(model_name="tiny", sampling_defaults={"repetition_penalty": 3.0})
    with BackgroundServer(create_app(engine, settings)) as server:
        ids = list(range(40, 48))
        omitted = _ws_ids(server, ids, 10, {})
        assert omitted == _ws_ids(server, ids, 10, {"repetition_penalty": 3.0})
        assert omitted != _ws_ids(server, ids, 10, {"repetition_penalty": 1.0})
        body = {"prompt": ids, "max_tokens": 10, "temperature": 0, "logprobs": 0}
        whole = httpx.post(server.url + "/v1/completions", json=body).json()
        assert len(whole["choices"][0]["logprobs"]["token_logprobs"]) == 10
