"""``GET /v1/runs/NAME:route``: where a caller on this machine may call a Run without the gateway
(docs/protocol.md, "Calling runtimed directly") — its UID, its pod and that pod's runtimed on a
Unix socket of the stack's private directory. Only when the gateway serves a stack of this
machine (it has a spool, so a caller can prove it shares the machine and the user: the client
checks the spool is its own and 0700); else ``route`` is null and the caller goes through the
gateway, as every caller from another machine does. A replica set has no one route (its caller
picks each call's replica among them, "Replicas"), but names each replica's: for a call, and
a map's batches ("Batches").
"""

from __future__ import annotations

import contextlib
from typing import Any

from fnkernel.runtime_server import tracing
from fnkernel.runtime_server.errors import NoRuntimePod, RunNotFound, RunNotReady
from fnkernel.runtime_server.lifecycle.gateway.handlers import BaseHandler
from fnkernel.runtime_server.lifecycle.runs import Run, replica_names


class RouteHandler(BaseHandler):
    def get(self, name: str) -> None:
        run = self.gateway.store.get_fresh(name)
        route: dict[str, Any] | None = None
        replicas: list[dict[str, Any]] | None = None
        why, lasting = "", True  # lasting: as long as the Run is this one
        if self.gateway.spool is None:
            why = "this gateway serves pods of another machine"
        elif tracing.exporting():
            why = "this stack exports every call's spans, the gateway's among them"
        elif run.spec.replicas != 1 and not run.spec.replica_of:
            # Each replica's route, for a caller to pick each call's replica itself; none while
            # one has none (it may have, later).
            why = "a replica set: the caller picks the replica of each call"
            replicas = self._replicas(run)
            lasting = replicas is not None
        else:
            route, why, lasting = self._route(run)
        answer: dict[str, Any] = {"route": route, "why": why, "lasting": lasting and route is None}
        if replicas is not None:
            answer["replicas"] = replicas
        self.send_json(200, answer)

    def _route(self, run: Run) -> tuple[dict[str, Any] | None, str, bool]:
        """The Run's route, or None, why, and whether that lasts as long as the Run."""
        try:
            pod, address = self.gateway.pod_of(run)
        except (NoRuntimePod, RunNotReady) as exc:
            return None, str(exc), False  # it may be, later
        if not address.startswith("unix:"):
            return None, f"runtimed listens on {address}, not a Unix socket", True
        return {"runUid": run.uid, "pod": pod, "runtimed": address}, "", True

    def _replicas(self, run: Run) -> list[dict[str, Any]] | None:
        """Each replica's route, in replica order; None unless every one has a route now."""
        routes = []
        for name in replica_names(run):
            replica = run
            if name != run.name:
                with contextlib.suppress(RunNotFound):
                    replica = self.gateway.store.get_fresh(name)
                if replica is run:
                    return None  # not made yet (a crash): the gateway's picks skip it
            route = self._route(replica)[0]
            if route is None:
                return None
            routes.append({"name": name, **route})
        return routes
