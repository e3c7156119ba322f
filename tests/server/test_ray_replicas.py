"""`pdflash serve --replicas N` on a local Ray instance (2 CPUs, replicas of one torch thread each),
through the official `openai` client: the front forwards to engine replicas, spreads streams over
them, keeps sessions and sockets on one, survives a replica killed mid-stream, merges /metrics.

Needs the `ray` extra (skipped without it); `.ci/run` runs these in a step of their own."""

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.exceptions import ConnectionClosedError
from websockets.sync.client import connect

pytest.importorskip("ray")
import ray

from pdflash.engine.async_engine import AsyncEngine
from pdflash.sampling import SamplingParams
from pdflash.server import BackgroundServer, ServerSettings
from pdflash.server.ray_front import ReplicaFront
from pdflash.server.ray_launch import APP_NAME, DEPLOYMENT_NAME, ReplicaOptions, ray_replicas
from pdflash.server.replica import ReplicaSpec
from pdflash.target.tiny import write_tiny_drafter

pytestmark = pytest.mark.ray
MODEL = "tiny"
HEADER = "x-pdflash-replica"
PROMPTS = [[1 + i, 7 + 3 * i, 42, 5 + i % 4] for i in range(16)]
SETTINGS = ServerSettings(model_name=MODEL, default_max_tokens=16, stats_interval_s=0.2)


@pytest.fixture(scope="module")
def drafter_dir(tiny_target, tmp_path_factory):
    return write_tiny_drafter(tmp_path_factory.mktemp("drafter"), tiny_target)


@pytest.fixture(scope="module")
def engine_options(tiny_target, drafter_dir):
    return {"target": tiny_target, "drafter": drafter_dir, "block_size": 4, "max_num_seqs": 16}


@pytest.fixture(scope="module")
def one_engine_greedy(engine_options):
    """The oracle: each prompt's greedy text from one AsyncEngine in this process (no Ray)."""
    options = dict(engine_options)
    engine = AsyncEngine.from_pretrained(options.pop("target"), options.pop("drafter"), **options)

    async def run() -> list[str]:
        async with engine:

            async def one(prompt):
                chunks = [out.text async for out in engine.generate(prompt, SamplingParams(max_tokens=16))]
                return "".join(chunks)

            return list(await asyncio.gather(*(one(p) for p in PROMPTS)))

    return asyncio.run(run())


@pytest.fixture(scope="module")
def cluster(engine_options):
    """Two replicas behind a front on a loopback port; `health` holds the /health codes seen while loading."""
    options = ReplicaOptions(replicas=2, cpus_per_replica=1)
    with ray_replicas(options, ReplicaSpec(engine_options=engine_options, settings=SETTINGS)) as replicas:
        # requests with a `user` stay on its replica; the others (most tests here) are balanced
        with BackgroundServer(ReplicaFront(replicas, SETTINGS, session_field="user")) as server:
            codes = []
            deadline = time.monotonic() + 120
            while True:
                health = httpx.get(server.url + "/health", timeout=30)
                codes.append(health.status_code)
                if health.status_code == 200 and health.json()["ready_replicas"] == 2:
                    break
                assert time.monotonic() < deadline, health.text
                time.sleep(0.2)
            yield {"server": server, "replicas": replicas, "health": codes}


@pytest.fixture
def client(cluster):
    return openai.OpenAI(base_url=cluster["server"].url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_health_is_503_until_a_replica_is_ready_then_200(cluster):
    codes = cluster["health"]
    assert codes[0] == 503 and codes[-1] == 200, codes


def test_sixteen_concurrent_streams_over_two_replicas_match_one_engine(cluster, one_engine_greedy):
    client = openai.AsyncOpenAI(base_url=cluster["server"].url + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def stream(prompt):
        raw = await client.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        chunks = [chunk async for chunk in raw.parse()]
        return raw.headers[HEADER], "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    async def run():
        return await asyncio.gather(*(stream(p) for p in PROMPTS))

    results = asyncio.run(run())
    assert [text for _, text, _ in results] == one_engine_greedy
    assert {reason for _, _, reason in results} == {"length"}
    assert len({replica for replica, _, _ in results}) == 2, "both replicas served some of the streams"


def test_chat_models_and_errors_answer_as_one_server_does(client, cluster):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert raw.headers[HEADER] and raw.parse().choices[0].message.role == "assistant"
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.BadRequestError) as error:  # validated on the replica, answered unchanged
        client.completions.create(model=MODEL, prompt=[1], max_tokens=4, temperature=-1)
    assert error.value.body["param"] == "temperature"
    assert httpx.get(cluster["server"].url + "/").headers[HEADER]  # the demo page too


def test_a_websocket_stays_on_one_replica_for_its_lifetime(cluster, one_engine_greedy):
    with connect(cluster["server"].ws_url) as ws:
        replica = ws.response.headers[HEADER]
        for i in range(3):
            ws.send(json.dumps({"type": "start", "id": i, "prompt": PROMPTS[i], "params": {"max_tokens": 16}}))
        texts, stats = {0: "", 1: "", 2: ""}, 0
        done = set()
        while len(done) < 3:
            message = json.loads(ws.recv(timeout=60))
            if message["type"] == "delta":
                texts[message["id"]] += message["text"]
            elif message["type"] == "stats":
                stats += 1
            else:
                assert message["type"] == "done", message
                done.add(message["id"])
    assert [texts[i] for i in range(3)] == one_engine_greedy[:3]
    health = httpx.get(cluster["server"].url + "/health").json()
    assert replica in {r["replica"] for r in health["replicas"]}


def test_session_field_keeps_a_conversation_on_the_replica_that_served_it(client):
    served = {user: set() for user in ("alice", "bob", "carol", "dave")}
    for _ in range(6):
        for user in served:
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt=[1, 2], max_tokens=2, user=user, temperature=0
            )
            served[user].add(raw.headers[HEADER])
    assert all(len(replicas) == 1 for replicas in served.values()), served


def test_metrics_carry_every_replica_with_a_replica_label(cluster):
    response = httpx.get(cluster["server"].url + "/metrics")
    ids = set(response.headers[HEADER].split(","))
    labelled = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            labelled.setdefault(s.name, {}).setdefault(s.labels["replica"], 0.0)
            labelled[s.name][s.labels["replica"]] += s.value
    assert len(ids) == 2 and set(labelled["pdflash_live_sequences"]) == ids
    served = labelled["pdflash_generated_tokens_total"]
    assert set(served) == ids and all(v > 0 for v in served.values()), served  # both generated tokens


def _replica_actor(replica_id):
    return ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT_NAME}#{replica_id}", namespace="serve")


def test_a_killed_replica_ends_its_streams_with_an_error_and_ray_brings_it_back(cluster, client):
    url = cluster["server"].url
    with connect(cluster["server"].ws_url) as socket:
        victim = socket.response.headers[HEADER]  # the replica to kill: the one holding this socket
        socket.send(json.dumps({"type": "start", "id": "long", "prompt": PROMPTS[0], "params": {"max_tokens": 400}}))
        streams = []
        for prompt in PROMPTS[:6]:
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt=prompt, max_tokens=400, temperature=0, stream=True
            )
            streams.append((raw.headers[HEADER], iter(raw.parse())))
        served = {replica for replica, _ in streams}
        assert victim in served and len(served) == 2, "the streams landed on both replicas"
        for _, chunks in streams:
            next(chunks)  # every stream is under way
        endings = {}

        def read_socket():
            while (message := json.loads(socket.recv(timeout=30)))["type"] in ("delta", "stats"):
                pass
            with pytest.raises(ConnectionClosedError) as closed:
                socket.recv(timeout=10)
            endings["socket"] = ((message["code"], closed.value.rcvd.code), time.monotonic())

        def read(index, chunks):
            try:
                endings[index] = ([c.choices[0].finish_reason for c in chunks][-1], time.monotonic())
            except openai.APIError as error:
                endings[index] = (str(error), time.monotonic())

        readers = [threading.Thread(target=read, args=(i, chunks)) for i, (_, chunks) in enumerate(streams)]
        readers.append(threading.Thread(target=read_socket))
        killed_at = time.monotonic()
        ray.kill(_replica_actor(victim), no_restart=True)
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout=120)
        for i, (replica, _) in enumerate(streams):
            ending, at = endings[i]
            if replica == victim:
                assert "the replica serving this request failed" in ending and at - killed_at < 10, (
                    ending,
                    at - killed_at,
                )
            else:
                assert ending == "length"  # the other replica's streams complete
        ending, at = endings["socket"]
        assert ending == ("replica_failed", 1011) and at - killed_at < 10, (ending, at - killed_at)
    answer = client.completions.create(model=MODEL, prompt=[3, 4], max_tokens=4, temperature=0)
    assert answer.choices[0].finish_reason == "length"
    deadline = time.monotonic() + 90
    while True:  # the Serve controller replaces the dead replica with a new one
        health = httpx.get(url + "/health").json()
        ids = {r["replica"] for r in health["replicas"] if r["running"]}
        if len(ids) == 2 and victim not in ids:
            break
        assert time.monotonic() < deadline, health
        time.sleep(0.5)
