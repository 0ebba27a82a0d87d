"""Live output at the gateway (docs/protocol.md, "Live output"): an invocation's log records, as
NDJSON, from the pod's runtimed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any

import grpc
import grpc.aio
from tornado import iostream

from fnkernel.runtime_server import limits
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import logs_pb2
from fnkernel.runtime_server.errors import (
    InvalidField,
)
from fnkernel.runtime_server.lifecycle.gateway.failures import (
    FailureResponse,
    rpc_error,
)
from fnkernel.runtime_server.lifecycle.gateway.handlers import BaseHandler
from fnkernel.runtime_server.wire import (
    POD_KEY,
)

# A follower that has not taken a line this long after it was written is cut off.
FOLLOW_FLUSH_SECONDS = 30.0


class LogsHandler(BaseHandler):
    """GET /v1/runs/{name}/invocations/{id}/logs and /v1/runs/{name}/logs (the call in flight,
    else the last one): an invocation's log lines as NDJSON, streamed while it runs with
    ``?follow=1`` (docs/protocol.md, "Live output")."""

    parameters = {"get": ("follow",)}

    def prepare(self) -> Awaitable[None] | None:
        self._call: Any = None
        return super().prepare()

    def on_connection_close(self) -> None:
        super().on_connection_close()
        if self._call is not None:
            self._call.cancel()  # the follower left: so does the stream behind it

    async def get(self, name: str, invocation_id: str = "") -> None:
        follow = self.get_query_argument("follow", "0", strip=False)
        if follow not in ("0", "1", "false", "true"):
            raise InvalidField("follow", f"must be 1 or 0 (true or false), got {follow[:40]!r}")
        if invocation_id:
            invocation_id = limits.check_invocation_id(invocation_id)
        run = self.gateway.store.get_fresh(name)
        replica = self.gateway.routed.get(invocation_id) if invocation_id else None
        if replica is not None and run.spec.replicas != 1 and not run.spec.replica_of:
            run = self.gateway.store.get_fresh(replica)
        pod, address = self.gateway.pod_of(run)
        request = logs_pb2.FollowInvocationLogsRequest(
            run_uid=run.uid, invocation_id=invocation_id, follow=follow in ("1", "true")
        )
        deadline = limits.wait_seconds(limits.MAX_TIMEOUT_MILLIS, hops_below=1)  # the longest call
        call = self.gateway.logs_stub(address).FollowInvocationLogs(
            request, timeout=deadline, metadata=((POD_KEY, pod),)
        )
        self._call = call
        records = aiter(call)
        try:
            first = await anext(records)
        except grpc.aio.AioRpcError as err:
            raise rpc_error(err, run, invocation_id) from None
        except StopAsyncIteration:  # runtimed always names the invocation first
            raise FailureResponse(
                "UNAVAILABLE", f'"{run.name}": the log stream ended at once'
            ) from None
        except asyncio.CancelledError:
            return  # the client went away
        self.set_header("Content-Type", "application/x-ndjson")
        self.set_header("Cache-Control", "no-store")
        head = {"invocationId": first.invocation_id, "run": run.name, "running": first.running}
        if not await self._send(head):
            return
        try:
            async for record in records:
                line = {"stream": record.stream, "text": record.text}
                if record.cut:
                    line["cut"] = True
                if not await self._send(line):
                    return
        except grpc.aio.AioRpcError as err:
            failure = rpc_error(err, run, first.invocation_id)
            await self._send({"error": {"code": failure.code, "message": failure.message}})
        except asyncio.CancelledError:
            return
        else:
            if request.follow or not first.running:  # else a look at a call still running
                await self._send({"end": True})
        self.finish()

    async def _send(self, record: dict[str, Any]) -> bool:
        """Write one NDJSON line; False (and the stream cancelled) if the client does not take
        it within FOLLOW_FLUSH_SECONDS or has gone."""
        self.write(json.dumps(record) + "\n")
        try:
            await asyncio.wait_for(self.flush(), FOLLOW_FLUSH_SECONDS)
        except (TimeoutError, iostream.StreamClosedError):
            self._call.cancel()
            self.request.connection.close()  # type: ignore[union-attr]
            return False
        return True
