"""Hostile input against a real server: generated JSON bodies and websocket frames, the cases
issue 20 found (10 MB bodies, deep nesting, huge seeds, NaN), never a 500 or a traceback,
/health answering while a large body is refused, and RSS back near its baseline."""

import json
import logging
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from pdflash.engine.async_engine import AsyncEngine
from pdflash.server import BackgroundServer, ServerSettings, create_app
from pdflash.server.limits import Limits

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
)
FIELDS = st.sampled_from(
    [
        "prompt",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "n",
        "logprobs",
        "top_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
        "min_tokens",
        "ignore_eos",
        "stream",
        "stream_options",
        "model",
    ]
)
BODIES = st.dictionaries(FIELDS, JSON, max_size=6).map(lambda b: {"max_tokens": 2, **b} if "max_tokens" not in b else b)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


class Tracebacks(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        if record.exc_info or record.levelno >= logging.ERROR:
            self.records.append(self.format(record))


@pytest.fixture(scope="module")
def server(tiny_target):
    engine = AsyncEngine.from_pretrained(tiny_target, max_num_seqs=8)
    limits = Limits(max_body_bytes=1024 * 1024, max_ws_message_bytes=256 * 1024)
    app = create_app(engine, ServerSettings(model_name="tiny", default_max_tokens=4, limits=limits))
    handler = Tracebacks()
    for name in ("", "uvicorn"):  # uvicorn's loggers do not propagate to the root
        logging.getLogger(name).addHandler(handler)
    with BackgroundServer(app) as running:
        running.errors = handler.records
        yield running
    for name in ("", "uvicorn"):
        logging.getLogger(name).removeHandler(handler)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def post(http, path, content, **headers):
    return http.post(path, content=content, headers={"content-type": "application/json", **headers})


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODIES, chat=st.booleans())
def test_generated_bodies_never_get_a_500(server, http, body, chat):
    r = post(http, "/v1/chat/completions" if chat else "/v1/completions", json.dumps(body).encode())
    assert r.status_code < 500 or r.status_code == 503, r.text
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert not server.errors, server.errors


START = st.builds(
    lambda p: json.dumps({"type": "start", "id": 1, "prompt": "ab", "params": p}),
    st.dictionaries(FIELDS, JSON, max_size=3),
)
FRAMES = st.lists(st.one_of(JSON.map(json.dumps), st.text(max_size=40), START), min_size=1, max_size=4)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames=FRAMES)
def test_generated_websocket_frames_get_errors_and_the_socket_stays_usable(server, frames):
    with connect(server.ws_url) as ws:
        for frame in frames:
            ws.send(frame)
        ws.send(json.dumps({"type": "start", "id": "probe", "prompt": "ab", "params": {"max_tokens": 2}}))
        while True:
            message = json.loads(ws.recv(timeout=30))
            assert message.get("code") != "internal_error", message
            if message["type"] == "done" and message["id"] == "probe":
                break
    assert not server.errors, server.errors


@pytest.mark.parametrize(
    ("content", "status", "code"),
    [
        (b'{"prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "invalid_json"),
        (b'{"prompt": "a", "x": ' + b"[" * 40 + b"]" * 40 + b"}", 400, "invalid_json"),  # deeper than 32
        (b'{"prompt": "a", "temperature": NaN}', 400, "invalid_json"),
        (b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", 400, "invalid_json"),  # past int digit limit
        (b'{"prompt": "a", "seed": 18446744073709551616, "temperature": 1}', 400, None),
        (b'{"prompt": "a", "top_k": 99999999999999999999}', 400, None),
        (b'{"prompt": [1, 99999999999999999999]}', 400, None),
        (b"\xff\xfe", 400, "invalid_json"),
    ],
)
def test_listed_hostile_bodies_are_400s(server, http, content, status, code):
    r = post(http, "/v1/completions", content)
    assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    assert not server.errors, server.errors


def test_non_json_content_type_is_refused(http):
    body = json.dumps({"prompt": "a", "max_tokens": 2})
    r = http.post("/v1/completions", content=body, headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"


def test_huge_bodies_are_413_while_health_answers_fast_and_memory_returns(server, http):
    baseline = rss_mb()
    big = json.dumps({"prompt": "x " * 5_000_000}).encode()  # 10 MB
    latencies, stop = [], threading.Event()

    def poll():
        with httpx.Client(base_url=server.url, timeout=5) as h:
            while not stop.is_set():
                t = time.perf_counter()
                assert h.get("/health").status_code == 200
                latencies.append(time.perf_counter() - t)
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for _ in range(3):
            with httpx.Client(base_url=server.url, timeout=30) as h:
                r = post(h, "/v1/completions", big)
                assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            with httpx.Client(base_url=server.url, timeout=30) as h:  # chunked: no Content-Length to trust
                r = h.post(
                    "/v1/completions",
                    content=iter([big[i : i + 65536] for i in range(0, len(big), 65536)]),
                    headers={"content-type": "application/json"},
                )
                assert r.status_code == 413
    finally:
        stop.set()
        poller.join()
    assert max(latencies) < 0.1, max(latencies)
    assert rss_mb() - baseline < 50
    with connect(server.ws_url, max_size=None) as ws:  # a websocket message over the limit closes that socket
        ws.send("x" * (300 * 1024))
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                ws.recv(timeout=10)
    assert closed.value.rcvd.code == 1009  # "message too big"
    assert http.get("/health").status_code == 200  # ... and nothing else
    assert not server.errors, server.errors


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ('{"type": "start", "id": 1, "prompt": "a", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "invalid_json"),
        ('{"type": "start", "id": 1, "prompt": "a", "params": {"temperature": NaN}}', "invalid_json"),
        ('{"type": "start", "id": 1, "prompt": "a", "params": {"seed": 18446744073709551616}}', "invalid_params"),
        ('{"type": "start", "id": 1, "prompt": [1, 99999999999999999999]}', "invalid_request"),
        ('{"type": "start", "id": 1, "prompt": "a", "params": {"max_tokens": 5000}}', "context_length_exceeded"),
    ],
)
def test_listed_hostile_websocket_frames_get_their_error(server, frame, code):
    with connect(server.ws_url) as ws:
        ws.send(frame)
        while (message := json.loads(ws.recv(timeout=30)))["type"] != "error":
            pass
        assert message["code"] == code, message
    assert not server.errors, server.errors
