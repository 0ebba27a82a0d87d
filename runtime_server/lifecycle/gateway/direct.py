"""``GET /v1/runs/NAME:route``: where a caller on this machine may call a Run without the gateway
(docs/protocol.md, "Calling runtimed directly") — its UID, its pod and that pod's runtimed on a
Unix socket of the stack's private directory. Only when the gateway serves a stack of this
machine (it has a spool, so a caller can prove it shares the machine and the user: the client
checks the spool is its own and 0700) and the Run is a single one; else ``route`` is null and
the caller goes through the gateway, as every caller from another machine does.
"""

from __future__ import annotations

from typing import Any

from fnkernel.runtime_server import tracing
from fnkernel.runtime_server.errors import NoRuntimePod, RunNotReady
from fnkernel.runtime_server.lifecycle.gateway.handlers import BaseHandler


class RouteHandler(BaseHandler):
    def get(self, name: str) -> None:
        run = self.gateway.store.get_fresh(name)
        route: dict[str, Any] | None = None
        why, lasting = "", True  # lasting: as long as the Run is this one
        if self.gateway.spool is None:
            why = "this gateway serves pods of another machine"
        elif tracing.exporting():
            why = "this stack exports every call's spans, the gateway's among them"
        elif run.spec.replicas != 1 and not run.spec.replica_of:
            why = "a replica set: the gateway picks the replica of each call"
        else:
            try:
                pod, address = self.gateway.pod_of(run)
            except (NoRuntimePod, RunNotReady) as exc:
                why, lasting = str(exc), False  # it may be, later
            else:
                if address.startswith("unix:"):
                    route = {"runUid": run.uid, "pod": pod, "runtimed": address}
                else:
                    why = f"runtimed listens on {address}, not a Unix socket"
        self.send_json(200, {"route": route, "why": why, "lasting": lasting and route is None})
