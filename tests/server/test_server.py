"""`pdflash serve`: the OpenAI endpoints (through the official client), errors, overload,
disconnects, the websocket protocol, /metrics and the CLI — against a real uvicorn server
on a loopback port, on tiny random checkpoints."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import connect

from pdflash.cli import main
from pdflash.engine.async_engine import AsyncEngine
from pdflash.server import BackgroundServer, ServerSettings, create_app
from pdflash.target.tiny import write_tiny_drafter

MODEL = "tiny"
ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def drafter_dir(tiny_target, tmp_path_factory):
    return write_tiny_drafter(tmp_path_factory.mktemp("drafter"), tiny_target)


@pytest.fixture(scope="module")
def server(tiny_target, drafter_dir):
    """DFlash (block 4) with offloaded experts behind a half-size cache: every metric has data."""
    engine = AsyncEngine.from_pretrained(
        tiny_target,
        drafter_dir,
        block_size=4,
        max_num_seqs=8,
        offload={"expert_cache_fraction": 0.5, "link_gbps": 16.0},
    )
    app = create_app(engine, ServerSettings(model_name=MODEL, stats_interval_s=0.1, default_max_tokens=16))
    with BackgroundServer(app) as running:
        yield running


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def wait_until_idle(http, timeout_s=10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        health = http.get("/health").json()
        if health["live_sequences"] == 0 and health["waiting"] == 0 or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def metric_samples(http) -> dict:
    """name -> [(labels, value)] from /metrics."""
    samples = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def sample(samples, name, **labels) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


# -- the OpenAI endpoints -----------------------------------------------------------------


def test_openai_client_streams_completion_and_chat_equal_to_whole_responses(client):
    assert [m.id for m in client.models.list().data] == [MODEL]

    whole = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=20)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="def fib(n):", max_tokens=20, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert whole.choices[0].text and streamed == whole.choices[0].text
    assert whole.choices[0].finish_reason == "length" == [c for c in chunks if c.choices][-1].choices[0].finish_reason
    assert whole.usage.completion_tokens == 20 and chunks[-1].usage == whole.usage
    assert whole.model_extra["metrics"]["generated_tokens"] == 20  # pdflash extension: per-request metrics

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16)
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 16
    assert stream[-1].choices[0].finish_reason == chat.choices[0].finish_reason == "length"
    # the chat template was applied: the prompt is longer than the messages' text
    assert chat.usage.prompt_tokens > len("be brief") + len("hello")


def test_seeded_sampling_and_token_id_prompts_reproduce(client):
    kwargs = dict(
        model=MODEL, prompt=[1, 2, 3, 4], max_tokens=12, temperature=0.9, top_p=0.95, seed=7, extra_body={"top_k": 20}
    )
    first = client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    assert first.usage.prompt_tokens == 4 and streamed == first.choices[0].text


def test_stop_string_ends_the_text_before_it(client):
    text = client.completions.create(model=MODEL, prompt="abc", max_tokens=24).choices[0].text
    stop = text[5:7]
    assert stop  # the tiny model's greedy continuation, cut at a string it contains
    stopped = client.completions.create(model=MODEL, prompt="abc", max_tokens=24, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        (b"{not json", 400, None, "invalid_json"),
        (b"[1, 2]", 400, None, None),
        ({"model": "gpt-5", "prompt": "hi"}, 404, "model", "model_not_found"),
        ({"prompt": "hi", "temperature": -1}, 400, "temperature", None),
        ({"prompt": "hi", "temperature": "hot"}, 400, "temperature", None),
        ({"prompt": "hi", "top_p": 0}, 400, "top_p", None),
        ({"prompt": "hi", "top_k": -3}, 400, "top_k", None),
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
        ({"prompt": "hi", "seed": 1.5}, 400, "seed", None),
        ({"prompt": "hi", "n": 17}, 400, "n", None),
        ({"prompt": "hi", "seed": 2**64, "temperature": 1}, 400, "seed", None),
        ({"prompt": "hi", "stream": "yes"}, 400, "stream", None),
        ({"prompt": "hi", "frobnicate": True}, 400, "frobnicate", None),
        ({"prompt": ""}, 400, "prompt", None),
        ({"prompt": [1, 99999]}, 400, "prompt", None),
        ({"prompt": ["a", "b"]}, 400, "prompt", None),
        ({"prompt": [5] * 2048}, 400, "prompt", "context_length_exceeded"),  # no room left in the 2048-token context
        ({"prompt": [5] * 2044, "max_tokens": 5}, 400, "max_tokens", "context_length_exceeded"),
        ({"prompt": [5] * 2044, "max_tokens": 4}, 200, None, None),  # exactly the 4 tokens left
    ],
)
def test_bad_completion_requests_get_openai_errors_and_the_server_keeps_serving(http, body, status, param, code):
    content = body if isinstance(body, bytes) else json.dumps({"max_tokens": 4, **body}).encode()
    r = http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    if status != 200:
        error = r.json()["error"]
        assert set(error) == ERROR_FIELDS and error["message"]
        assert error["param"] == param and error["code"] == code
        assert error["type"] == "invalid_request_error"
    assert http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_bad_chat_requests_name_the_field(http, body, param):
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_unknown_model_through_the_client_and_unknown_routes(client, http):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    assert client.models.retrieve(MODEL).id == MODEL
    r = http.get("/v2/whatever")
    assert r.status_code == 404 and set(r.json()["error"]) == ERROR_FIELDS
    r = http.get("/v1/completions")
    assert r.status_code == 405 and set(r.json()["error"]) == ERROR_FIELDS


def test_health_and_demo_page_assets(http):
    assert http.get("/health").json()["status"] == "ok"
    page = http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for asset in ("/static/demo.js", "/static/demo.css"):
        assert asset in page.text and http.get(asset).status_code == 200
    assert "http://" not in page.text and "https://" not in page.text  # no CDN: everything is served here


# -- disconnects and overload ---------------------------------------------------------------


def test_client_disconnect_mid_stream_aborts_the_request(server, http):
    before = sample(metric_samples(http), "pdflash_engine_requests_total", outcome="aborted")
    with httpx.Client(base_url=server.url, timeout=30) as leaving:
        with leaving.stream("POST", "/v1/completions", json={"prompt": "go", "max_tokens": 1500, "stream": True}) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            first = json.loads(next(lines)[6:])
            assert first["choices"][0]["finish_reason"] is None
            assert http.get("/health").json()["live_sequences"] == 1
        # leaving the block closes the connection mid-stream
    assert wait_until_idle(http, 5.0)["live_sequences"] == 0
    assert sample(metric_samples(http), "pdflash_engine_requests_total", outcome="aborted") == before + 1


def test_client_timeout_on_a_whole_response_aborts_it(server, http):
    before = sample(metric_samples(http), "pdflash_engine_requests_total", outcome="aborted")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": "go", "max_tokens": 1500}, timeout=0.5)
    assert wait_until_idle(http, 5.0)["live_sequences"] == 0
    assert sample(metric_samples(http), "pdflash_engine_requests_total", outcome="aborted") == before + 1


def test_a_full_queue_answers_503_and_the_server_recovers(tiny_target):
    engine = AsyncEngine.from_pretrained(tiny_target, max_num_seqs=1, max_waiting=1)
    app = create_app(engine, ServerSettings(model_name=MODEL))
    long = {"prompt": "hold", "max_tokens": 1500, "stream": True}
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        with httpx.Client(base_url=srv.url, timeout=30) as a, httpx.Client(base_url=srv.url, timeout=30) as b:
            with a.stream("POST", "/v1/completions", json=long) as running:
                lines = running.iter_lines()  # keep a reference: a collected line iterator closes the connection
                next(line for line in lines if line.startswith("data: "))  # it is generating
                with b.stream("POST", "/v1/completions", json=long) as queued:
                    assert queued.status_code == 200  # accepted: headers go out while it waits
                    assert http.get("/health").json()["waiting"] == 1
                    r = http.post("/v1/completions", json={"prompt": "one more", "max_tokens": 2})
                    assert r.status_code == 503 and r.headers["retry-after"] == "1"
                    assert r.json()["error"]["code"] == "overloaded" and set(r.json()["error"]) == ERROR_FIELDS
                    with pytest.raises(openai.InternalServerError):
                        openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0).completions.create(
                            model=MODEL, prompt="x", max_tokens=2
                        )
        assert wait_until_idle(http)["live_sequences"] == 0
        assert http.post("/v1/completions", json={"prompt": "again", "max_tokens": 2}).status_code == 200
        assert sample(metric_samples(http), "pdflash_requests_total", endpoint="/v1/completions", status="503") == 2


# -- the websocket --------------------------------------------------------------------------


def receive_until_done(ws, ids, *, cancel_after_first_delta=None):
    """Collect messages until every id in `ids` is done; returns (deltas by id, done by id, others)."""
    deltas, done, others = {i: [] for i in ids}, {}, []
    while len(done) < len(ids):
        msg = json.loads(ws.recv(timeout=30))
        if msg["type"] == "delta":
            deltas[msg["id"]].append(msg)
            if msg["id"] == cancel_after_first_delta and len(deltas[msg["id"]]) == 1:
                ws.send(json.dumps({"type": "cancel", "id": msg["id"]}))
        elif msg["type"] == "done":
            done[msg["id"]] = msg
        else:
            others.append(msg)
    return deltas, done, others


def test_websocket_runs_three_generations_at_once_and_cancels_one(server, client, http):
    expected = client.completions.create(model=MODEL, prompt="alpha", max_tokens=24).choices[0].text
    with connect(server.ws_url) as ws:
        for gen_id, prompt, max_tokens in (("a", "alpha", 24), ("b", "beta", 1500), (3, "gamma", 24)):
            ws.send(json.dumps({"type": "start", "id": gen_id, "prompt": prompt, "params": {"max_tokens": max_tokens}}))
        deltas, done, others = receive_until_done(ws, ["a", "b", 3], cancel_after_first_delta="b")
    assert done["b"]["finish_reason"] == "abort"
    for gen_id in ("a", 3):
        assert done[gen_id]["finish_reason"] == "length"
        tokens = [t for d in deltas[gen_id] for t in d["token_ids"]]
        assert len(tokens) == done[gen_id]["metrics"]["generated_tokens"] == 24
        rounds = [n for d in deltas[gen_id] for n in d["acceptance_lengths"]]
        assert rounds == done[gen_id]["metrics"]["acceptance_lengths"] and sum(rounds) == 23
        blocks = [n for d in deltas[gen_id] for n in d["block_sizes"]]  # the policy's block, per round
        assert blocks == done[gen_id]["metrics"]["block_sizes"] and len(blocks) == len(rounds)
        assert all(n <= b for n, b in zip(rounds, blocks))  # a round emits at most what it verified
        assert sum(d["expert_bytes"] for d in deltas[gen_id]) == done[gen_id]["metrics"]["expert_bytes"] > 0
    assert "".join(d["text"] for d in deltas["a"]) == expected  # same tokens as the HTTP path
    # the three ran at once: each had output before the first one finished
    assert all(deltas[i] for i in ("a", "b", 3))
    stats = [m for m in others if m["type"] == "stats"]
    assert stats and {"live_sequences", "expert_bytes_fetched", "expert_cache_hit_rate", "link"} <= set(stats[-1])
    assert stats[-1]["link"] == "emulated" and isinstance(stats[-1]["expert_bytes_fetched"], int)
    assert stats[-1]["drafts_vetoed"] == 0  # three short requests: too few rounds to compare blocks with plain
    assert 0 <= stats[-1]["expert_cache_hit_rate"] <= 1
    assert wait_until_idle(http, 5.0)["live_sequences"] == 0


@pytest.mark.parametrize(
    ("message", "code", "param"),
    [
        ("this is not json", "invalid_json", None),
        ('["start"]', "invalid_message", None),
        ('{"type": "fly"}', "unknown_type", "type"),
        ('{"type": "start", "prompt": "x"}', "invalid_message", "id"),
        ('{"type": "start", "id": true, "prompt": "x"}', "invalid_message", "id"),
        ('{"type": "start", "id": "m"}', "invalid_message", "prompt"),
        ('{"type": "start", "id": "m", "prompt": "x", "colour": 1}', "invalid_message", "colour"),
        (
            '{"type": "start", "id": "m", "prompt": "x", "params": {"temperature": -1}}',
            "invalid_params",
            "params.temperature",
        ),
        (
            '{"type": "start", "id": "m", "prompt": "x", "params": {"max_tokens": "many"}}',
            "invalid_params",
            "params.max_tokens",
        ),
        ('{"type": "start", "id": "m", "prompt": "x", "params": {"beam": 4}}', "invalid_params", "params.beam"),
        ('{"type": "start", "id": "m", "prompt": "x", "params": [1]}', "invalid_params", "params"),
        ('{"type": "start", "id": "m", "prompt": []}', "invalid_request", "prompt"),
        ('{"type": "start", "id": "m", "prompt": [999999]}', "invalid_request", "prompt"),
        ('{"type": "cancel", "id": "nobody"}', "unknown_id", "id"),
        (b"\x00binary", "invalid_message", None),
    ],
)
def test_websocket_malformed_messages_get_errors_and_the_socket_stays_usable(server, message, code, param):
    with connect(server.ws_url) as ws:
        ws.send(message)
        error = next(m for m in (json.loads(ws.recv(timeout=10)) for _ in range(20)) if m["type"] == "error")
        assert error["code"] == code and error["param"] == param and error["message"]
        ws.send(json.dumps({"type": "start", "id": "after", "prompt": "still here", "params": {"max_tokens": 3}}))
        _, done, _ = receive_until_done(ws, ["after"])
        assert done["after"]["finish_reason"] == "length"


def test_websocket_duplicate_running_id_is_refused_and_chat_messages_work(server):
    with connect(server.ws_url) as ws:
        start = {
            "type": "start",
            "id": "dup",
            "messages": [{"role": "user", "content": "hi"}],
            "params": {"max_tokens": 40},
        }
        ws.send(json.dumps(start))
        ws.send(json.dumps(start))
        deltas, done, others = receive_until_done(ws, ["dup"])
        errors = [m for m in others if m["type"] == "error"]
        # the error carries no id: "dup" gets exactly one final message, its own done
        assert [e["code"] for e in errors] == ["duplicate_id"] and errors[0]["id"] is None
        assert done["dup"]["finish_reason"] == "length" and done["dup"]["metrics"]["generated_tokens"] == 40
        ws.send(json.dumps({**start, "params": {"max_tokens": 2}}))  # finished ids may be reused
        assert receive_until_done(ws, ["dup"])[1]["dup"]["metrics"]["generated_tokens"] == 2


def test_closing_a_websocket_aborts_its_generations(server, http):
    aborted = sample(metric_samples(http), "pdflash_ws_generations_total", outcome="abort")
    with connect(server.ws_url) as ws:
        for i in range(3):
            ws.send(json.dumps({"type": "start", "id": i, "prompt": "long", "params": {"max_tokens": 1500}}))
        while json.loads(ws.recv(timeout=10))["type"] != "delta":
            pass
    assert wait_until_idle(http, 5.0)["live_sequences"] == 0
    # generations ended by the socket closing are counted too (issue 20, finding 6)
    assert sample(metric_samples(http), "pdflash_ws_generations_total", outcome="abort") == aborted + 3


# -- /metrics -------------------------------------------------------------------------------


def test_metrics_cover_requests_latency_acceptance_and_expert_traffic(client, http):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=8)
    malformed = http.post("/v1/completions", content=b"{", headers={"content-type": "application/json"})
    assert malformed.status_code == 400  # without the content type it would be a 415
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    s = metric_samples(http)
    assert sample(s, "pdflash_requests_total", endpoint="/v1/completions", status="200") >= 1
    assert sample(s, "pdflash_requests_total", endpoint="/v1/completions", status="400") >= 1
    assert sample(s, "pdflash_generated_tokens_total") >= 8
    for histogram in (
        "pdflash_time_to_first_token_seconds",
        "pdflash_inter_token_latency_seconds",
        "pdflash_acceptance_length",
        "pdflash_verify_block_tokens",
        "pdflash_request_admission_wait_seconds",
        "pdflash_verify_batch_size",
    ):
        assert sample(s, histogram + "_count") > 0, histogram
    assert sample(s, "pdflash_expert_bytes_fetched_total") > 0
    assert sample(s, "pdflash_link_busy_seconds_total") > 0  # the fetches took the emulated link's time
    assert 0 <= sample(s, "pdflash_expert_cache_hit_rate") <= 1
    assert sample(s, "pdflash_expert_link_bytes_per_second") == 16e9  # the emulated link's rate, priced by
    assert sample(s, "pdflash_expert_bytes_projected_total") > 0
    assert sample(s, "pdflash_live_sequences") == 0 and "pdflash_ws_connections" in s
    assert sample(s, "pdflash_prefills_held_total") == 0  # one request at a time: no seat-mate to wait for
    assert sample(s, "pdflash_prefills_in_verifies_total") == 0  # no verify was coming while it waited
    assert sample(s, "pdflash_drafts_vetoed_total") == 0  # too few rounds of either kind to compare


# -- the CLI --------------------------------------------------------------------------------


def test_serve_rejects_bad_settings_before_starting(capsys, tiny_target):
    assert main(["serve", "--target", str(tiny_target), "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs=0 is invalid" in capsys.readouterr().err
    assert main(["serve", "--target", str(tiny_target), "--default-max-tokens", "0"]) == 2
    assert "default_max_tokens=0 is invalid" in capsys.readouterr().err


def test_pdflash_serve_process_serves_and_stops_on_sigint(tiny_target, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdflash.cli",
            "serve",
            "--target",
            str(tiny_target),
            "--port",
            str(port),
            "--no-spec",
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json()
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.1)
        assert health["model"] == tiny_target.name
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"on http://127.0.0.1:{port}" in err


def test_health_reports_a_dead_engine_loop(tiny_target):
    engine = AsyncEngine.from_pretrained(tiny_target, None)

    def broken_admission(*args, **kwargs):
        raise RuntimeError("scheduler bug")

    app = create_app(engine, ServerSettings(model_name=MODEL))
    with BackgroundServer(app) as running, httpx.Client(base_url=running.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        engine.scheduler.tick = broken_admission
        failed = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
        assert failed.status_code == 500 and "error" in failed.json()
        health = http.get("/health")
        assert health.status_code == 503
        assert health.json()["status"] == "error" and "scheduler bug" in health.json()["error"]
