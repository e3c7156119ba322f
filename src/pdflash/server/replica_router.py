"""Which replica serves a request: Ray Serve's power of two choices, plus pins and session affinity.

Owns the deployment's request router (Ray's `RequestRouter` extension point; it runs in the
front's process, inside the deployment handle). A request's `route` keyword decides:
- None: Ray Serve's default, power of two choices on queue length;
- `("replica", id)`: that replica (a websocket's messages go to the replica holding the
  socket); if it is gone, any replica, which then refuses the unknown socket;
- `("session", key)`: the replica that last served `key` while it is running and accepts,
  else power of two choices (the front sets this from `--session-field`).
Must not touch request bodies: the front derives the route.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

MAX_SESSIONS = 65536  # affinity entries kept (least recently routed dropped first)


class ReplicaRouter(PowerOfTwoChoicesRequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self.sessions: OrderedDict[str, ReplicaID] = OrderedDict()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        kind, key = _route(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if kind == "replica" and key in by_id:
            return [[by_id[key]]]
        balanced = await super().choose_replicas(candidate_replicas, pending_request)
        if kind == "session" and key in self.sessions:
            home = by_id.get(self.sessions[key].unique_id)
            if home is not None:
                return [[home], *balanced]  # the later ranks only if the home replica refuses (full)
        return balanced

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        kind, key = _route(pending_request)
        if kind == "session":
            self.sessions[key] = replica_id
            self.sessions.move_to_end(key)
            if len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)


def _route(pending_request: PendingRequest | None) -> tuple[str | None, str]:
    route = pending_request.kwargs.get("route") if pending_request is not None else None
    return (route[0], route[1]) if route else (None, "")
