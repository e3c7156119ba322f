"""Starting and stopping the engine replicas of `pdflash serve --replicas N` on Ray Serve.

Owns the Ray side of the lifecycle: connecting to a cluster (`--ray-address`) or starting a
local Ray instance, checking that the cluster has the resources N replicas ask for,
deploying the EngineReplica deployment (N replicas, each `cpus_per_replica` CPUs and
`gpus_per_replica` GPUs, routed by server/replica_router.py) without Ray's own HTTP proxy,
and on exit removing it again: a local instance it started is shut down whole (every Ray
process it started ends); on a cluster only its application is deleted. Importing this
module imports Ray: only the `--replicas` path does.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator

import attrs
import ray
from ray import serve

from pdflash.checks import at_least
from pdflash.server.ray_front import ReplicaSet
from pdflash.server.replica import EngineReplica, ReplicaSpec

log = logging.getLogger(__name__)
APP_NAME = "pdflash"  # the Ray Serve application
DEPLOYMENT_NAME = "EngineReplica"
ROUTER = "pdflash.server.replica_router.ReplicaRouter"  # imported where the handle routes (the front)
CONTROL_CALLS = 32  # ongoing requests a replica takes beyond its engine's queue (websocket messages)


def _non_negative(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{attribute.name}={value!r} is invalid: it must be a number >= 0")


def _positive(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{attribute.name}={value!r} is invalid: it must be a number > 0")


@attrs.frozen(kw_only=True)
class ReplicaOptions:
    replicas: int = attrs.field(validator=at_least(1, integer=True))  # engine replicas
    ray_address: str | None = None  # a running cluster ("auto", "HOST:6379"); None: start a local instance
    cpus_per_replica: float = attrs.field(default=1.0, validator=_positive)  # Ray CPUs each replica reserves
    gpus_per_replica: float = attrs.field(default=0.0, validator=_non_negative)  # Ray GPUs each replica reserves
    session_field: str | None = None  # request field whose value keeps a conversation on one replica

    @property
    def torch_threads(self) -> int:
        return max(1, math.floor(self.cpus_per_replica))

    @property
    def local_cpus(self) -> int:
        """A local instance's CPUs: what the replicas reserve (Ray leaves the rest alone), at most the machine's."""
        return min(math.ceil(self.replicas * self.cpus_per_replica), os.cpu_count() or 1)


@contextlib.contextmanager
def ray_replicas(options: ReplicaOptions, spec: ReplicaSpec) -> Iterator[ReplicaSet]:
    """Deploy the replicas (not waiting for them to load: /health says when one is ready); remove them on exit."""
    connected_here = not ray.is_initialized()
    if connected_here:
        if options.ray_address is None:
            ray.init(num_cpus=options.local_cpus, include_dashboard=False)
        else:
            try:
                ray.init(address=options.ray_address)
            except ConnectionError as exc:
                raise ValueError(
                    f"--ray-address {options.ray_address!r}: no Ray cluster answers there ({exc}); "
                    "start one with `ray start --head` and give its address, or drop --ray-address"
                ) from None
    own_instance = connected_here and options.ray_address is None
    try:
        _check_resources(options)
        serve.start(proxy_location="Disabled")
        engine = spec.engine_options
        deployment = serve.deployment(
            name=DEPLOYMENT_NAME,
            num_replicas=options.replicas,
            ray_actor_options={"num_cpus": options.cpus_per_replica, "num_gpus": options.gpus_per_replica},
            max_ongoing_requests=engine.get("max_num_seqs", 64) + engine.get("max_waiting", 256) + CONTROL_CALLS,
            request_router_config={"request_router_class": ROUTER},
            logging_config={"enable_access_log": False},  # a line per token stream and websocket message
        )(EngineReplica)
        spec = attrs.evolve(spec, torch_threads=options.torch_threads)
        target = serve.RunTarget(deployment.bind(spec), name=APP_NAME, route_prefix=None)
        [handle] = serve.run_many([target], wait_for_applications_running=False)
        yield ReplicaSet(handle)
    finally:
        if own_instance:
            serve.shutdown()
            ray.shutdown()  # a local instance stops whole: GCS, raylet, workers
        else:
            with contextlib.suppress(Exception):  # the cluster stays; only our application goes
                serve.delete(APP_NAME)
            if connected_here:
                ray.shutdown()  # disconnects this driver


def _check_resources(options: ReplicaOptions) -> None:
    total = ray.cluster_resources()
    for name, each in (("CPU", options.cpus_per_replica), ("GPU", options.gpus_per_replica)):
        have = total.get(name, 0.0)
        if each * options.replicas > have:
            flag = f"--{name.lower()}s-per-replica"
            raise ValueError(
                f"{options.replicas} replicas x {each:g} {name}s ({flag}) need {each * options.replicas:g} {name}s; "
                f"the Ray cluster has {have:g}: use fewer replicas, a smaller {flag}, or add nodes"
            )
