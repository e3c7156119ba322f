"""Graceful shutdown of `pdflash serve` under live streams, and access control (API key, origins)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from pdflash.engine.async_engine import AsyncEngine
from pdflash.server import BackgroundServer, ServerSettings, create_app

KEY = "sk-test-0123456789"


def test_sigterm_ends_every_live_stream_with_its_final_message_and_exits_0(tiny_target, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "pdflash.cli",
        "serve",
        "--target",
        str(tiny_target),
        "--port",
        "0",
        "--max-num-seqs",
        "16",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = ""
        while not line.startswith("pdflash: serving"):
            line = proc.stderr.readline()
            assert line, "pdflash serve exited before announcing its URL"
        url = line.split(" on ", 1)[1].split()[0]
        deadline = time.monotonic() + 30
        while True:  # bound before the announcement; the engine starts right after
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        finals, started = {}, threading.Barrier(13)

        def sse(i):
            body = {"prompt": "ab", "max_tokens": 2000, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
                events = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 1:
                            started.wait()
                finals[f"sse{i}"] = (json.loads(events[-2])["choices"][0]["finish_reason"], events[-1])

        def ws(i):
            with connect(url.replace("http", "ws") + "/ws") as sock:
                sock.send(
                    json.dumps(
                        {"type": "start", "id": i, "prompt": "ab", "params": {"max_tokens": 2000, "ignore_eos": True}}
                    )
                )
                first = True
                while True:
                    m = json.loads(sock.recv(timeout=30))
                    if m["type"] == "delta" and first:
                        first = False
                        started.wait()
                    if m["type"] in ("done", "error"):
                        finals[f"ws{i}"] = (m.get("finish_reason"), m["type"])
                        return

        threads = [threading.Thread(target=sse, args=(i,)) for i in range(10)]
        threads += [threading.Thread(target=ws, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        started.wait(timeout=60)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=10)
        elapsed = time.monotonic() - sent
        for t in threads:
            t.join(timeout=10)
        err = proc.stderr.read()
    finally:
        proc.kill()
    assert rc == 0 and elapsed < 10, (rc, elapsed)
    assert finals == {
        **{f"sse{i}": ("abort", "[DONE]") for i in range(10)},
        "ws0": ("abort", "done"),
        "ws1": ("abort", "done"),
    }
    assert "Traceback" not in err and "CancelledError" not in err, err


@pytest.fixture(scope="module")
def keyed(tiny_target):
    engine = AsyncEngine.from_pretrained(tiny_target, max_num_seqs=4)
    settings = ServerSettings(
        model_name="tiny", default_max_tokens=4, api_key=KEY, allowed_origins=["http://ok.example"]
    )
    with BackgroundServer(create_app(engine, settings)) as running:
        yield running


def test_api_key_is_required_except_on_health_in_the_openai_error_shape(keyed):
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as error:
        client.completions.create(model="tiny", prompt="ab", max_tokens=2)
    assert error.value.status_code == 401 and error.value.body["code"] == "invalid_api_key"
    r = httpx.post(keyed.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(keyed.url + "/metrics").status_code == 401
    assert httpx.get(keyed.url + "/health").status_code == 200
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model="tiny", prompt="ab", max_tokens=2).choices[0].finish_reason == "length"


def test_websocket_authenticates_by_query_string_or_first_message(keyed):
    start = {"type": "start", "id": 1, "prompt": "ab", "params": {"max_tokens": 2}}
    for url, first in ((f"{keyed.ws_url}?api_key={KEY}", None), (keyed.ws_url, {"type": "auth", "api_key": KEY})):
        with connect(url) as ws:
            if first:
                ws.send(json.dumps(first))
            ws.send(json.dumps(start))
            while json.loads(ws.recv(timeout=30))["type"] != "done":
                pass
    with connect(keyed.ws_url) as ws:
        ws.send(json.dumps(start))  # not an auth message: refused and closed
        assert json.loads(ws.recv(timeout=10))["code"] == "invalid_api_key"


def test_cross_origin_websocket_and_post_are_refused_unless_allowed(keyed):
    for origin in ("http://evil.example", "null"):
        with pytest.raises(InvalidStatus) as refused:
            connect(f"{keyed.ws_url}?api_key={KEY}", origin=origin)
        assert refused.value.response.status_code == 403
        r = httpx.post(
            keyed.url + "/v1/completions",
            json={"prompt": "ab", "max_tokens": 2},
            headers={"origin": origin, "authorization": f"Bearer {KEY}"},
        )
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    r = httpx.post(
        keyed.url + "/v1/completions",
        json={"prompt": "ab", "max_tokens": 2},
        headers={"origin": "http://ok.example", "authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ok.example"
    with connect(f"{keyed.ws_url}?api_key={KEY}", origin=keyed.url):  # same-origin (the demo page)
        pass


@pytest.fixture(scope="module")
def default_server(tiny_target):
    engine = AsyncEngine.from_pretrained(tiny_target, max_num_seqs=4)
    with BackgroundServer(create_app(engine, ServerSettings(model_name="tiny", default_max_tokens=2))) as running:
        yield running


def test_by_default_only_the_servers_own_origin_may_call_it(default_server):
    body = {"prompt": "ab", "max_tokens": 2}
    evil = httpx.post(default_server.url + "/v1/completions", json=body, headers={"origin": "http://evil.example"})
    assert evil.status_code == 403 and evil.json()["error"]["code"] == "origin_not_allowed"
    simple = httpx.post(  # a CORS "simple request" a page may send without a preflight
        default_server.url + "/v1/completions", content=json.dumps(body), headers={"content-type": "text/plain"}
    )
    assert simple.status_code == 415
    own = httpx.post(default_server.url + "/v1/completions", json=body, headers={"origin": default_server.url})
    assert own.status_code == 200 and "access-control-allow-origin" not in own.headers
    assert httpx.post(default_server.url + "/v1/completions", json=body).status_code == 200  # no Origin: not a browser
    with pytest.raises(InvalidStatus) as refused:
        connect(default_server.ws_url, origin="http://evil.example")
    assert refused.value.response.status_code == 403


def test_preflight_answers_allowed_origins_only(keyed):
    ask = {"access-control-request-method": "POST", "access-control-request-headers": "authorization, content-type"}
    ok = httpx.options(keyed.url + "/v1/completions", headers={"origin": "http://ok.example", **ask})
    assert ok.status_code == 204 and ok.headers["access-control-allow-origin"] == "http://ok.example"
    assert "authorization" in ok.headers["access-control-allow-headers"]
    evil = httpx.options(keyed.url + "/v1/completions", headers={"origin": "http://evil.example", **ask})
    assert evil.status_code == 403
