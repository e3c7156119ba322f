"""The simulated engine's clients: closed-loop users and open-loop (Poisson) arrivals, and one point's result.

Owns turning a client pattern into arrival events on a Simulator's clock (a closed-loop client
sends its next request the moment its previous one finishes, as `pdflash bench` clients do)
and summarising the run. Must not model the engine: pdflash.bench.simulator does.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from pdflash.bench.metrics import PointResult, summarise
from pdflash.bench.sim_cache import SimulationError
from pdflash.bench.simulator import SimRequest, SimSetup, Simulator

Arrival = tuple[float, int, int, int | None]  # (time s, route, prompt tokens, client)


def simulate_closed_loop(
    setup: SimSetup, prompt_tokens: Sequence[int], *, concurrency: int, requests_per_client: int, max_tokens: int
) -> PointResult:
    """`concurrency` clients, each sending `requests_per_client` requests back to back (prompt
    i of client c is prompt (c * requests_per_client + i) mod n, as `pdflash bench` assigns them)."""
    n = len(prompt_tokens)
    first: list[Arrival] = []
    follow: dict[int, list[tuple[int, int]]] = {}
    for c in range(concurrency):
        routes = [(c * requests_per_client + r) % n for r in range(requests_per_client)]
        first.append((0.0, routes[0], prompt_tokens[routes[0]], c))
        follow[c] = [(r, prompt_tokens[r]) for r in routes[1:]]
    return _run(setup, first, follow, concurrency, max_tokens)


def simulate_open_loop(
    setup: SimSetup, prompt_tokens: Sequence[int], *, arrival_times_s: Sequence[float], max_tokens: int
) -> PointResult:
    """Requests arriving at the given times (a Poisson process, say), prompt i mod n each."""
    n = len(prompt_tokens)
    arrivals: list[Arrival] = [(t, i % n, prompt_tokens[i % n], None) for i, t in enumerate(arrival_times_s)]
    return _run(setup, arrivals, {}, 0, max_tokens)


def _run(
    setup: SimSetup,
    arrivals: list[Arrival],
    follow: dict[int, list[tuple[int, int]]],
    concurrency: int,
    max_tokens: int,
) -> PointResult:
    sim = Simulator(setup, max_tokens)
    limit = getattr(setup.routing, "output_tokens", lambda route: None)
    rids = iter(range(1 << 62))
    expected = len(arrivals) + sum(len(v) for v in follow.values())

    def send(time_s: float, route: int, prompt: int, client: int | None) -> None:
        tokens = min(max_tokens, limit(route) or max_tokens)
        q = SimRequest(next(rids), route, prompt, tokens, time_s, client)
        sim.clock.at(time_s, lambda: sim.arrive(q))

    def finished(q: SimRequest) -> None:
        queue = follow.get(q.client) if q.client is not None else None
        if queue:
            route, prompt = queue.pop(0)
            send(sim.now, route, prompt, q.client)

    sim.on_finish = finished
    for arrival in sorted(arrivals, key=lambda a: a[0]):
        send(*arrival)

    async def body() -> None:  # scheduler tickets are anyio events: they need a running loop
        sim.clock.run()

    anyio.run(body)
    if len(sim.done) != expected:
        raise SimulationError(f"the simulation stalled: {len(sim.done)} of {expected} requests finished")
    return summarise(
        setup.config.name,
        concurrency,
        sim.records(),
        sim.traffic(),
        sim.now,
        routing=setup.routing.description,
        costs=setup.costs.description,
        simulated=True,
        block_decisions=dict(sorted(sim.planner.decisions.items())),
        verify_batches=dict(sorted(sim.pacer.verify_batches.items())),
        prefill_batches=sim.prefill.batches,
        prefills_in_verifies=sim.pacer.prefills_in_verifies,
        in_flight_tick_share=sim.pacer.ticks_in_flight / max(1, sim.scheduler.stats().ticks),
    )
