"""A call on this machine without the gateway (docs/protocol.md, "Calling runtimed directly"):
runtimed's FunctionRuntime on the Unix socket the gateway names for the Run
(``GET /v1/runs/NAME:route``), called as the gateway calls it — the Run's UID, its pod for the
routing fence, the same metadata — and its answer or failure made into what the gateway would
have answered (``rpc.failure_body``, ``errors.from_response``), so a caller cannot tell the two
paths apart but by their speed.

Imported on a same-machine call's first use: it loads grpc, which the kernel's start must not.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from fnkernel.runtime_server import payloads, wire
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server.client.errors import RequestCancelled, from_response
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS, failure_body, trailer_logs

# What the gateway's HTTP headers carry, as the metadata it sends runtimed (gateway/invoke.py).
_METADATA_OF_HEADER = {
    wire.INPUT_REF_HEADER: wire.INPUT_REF_KEY,
    wire.OUTPUT_REF_FROM_HEADER: wire.OUTPUT_REF_FROM_KEY,
}

# Refusals that come before the call is dispatched (the Run is not there, or not routed to that
# pod): the call never ran, so it is made again through the gateway, which knows where it is.
_NEVER_RAN = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION})


@dataclass(frozen=True)
class Route:
    """Where the Run `name` is called on this machine: runtimed at `address`, on `pod`."""

    name: str
    run_uid: str
    pod: str
    address: str


class RouteGone(Exception):
    """The route no longer leads to the Run (moved, replaced, its pod gone) and the call was
    not made: make it through the gateway."""


class Direct:
    """The channels to this machine's runtimeds, and the calls in flight on them (``cancel``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[grpc.Channel, pb_grpc.FunctionRuntimeStub]] = {}
        self._calls: set[Any] = set()  # the futures of the calls in flight

    def invoke(
        self, route: Route, body: bytes, headers: Mapping[str, str], wait: float
    ) -> tuple[dict[str, str], bytes]:
        """InvokeFunction on `route` with what would have been the gateway request's `body`
        and `headers`: the headers and body the gateway would have answered. RouteGone if it
        never ran there, RequestCancelled if ``cancel`` stopped it, else the gateway's error
        for its failure."""
        request = pb.InvokeFunctionRequest(
            registration=pb.FunctionRegistration(run_uid=route.run_uid),
            invocation_id=headers.get(wire.INVOCATION_ID_HEADER, ""),
            input=body,
            content_type=headers.get("Content-Type", payloads.JSON),
            timeout_millis=int(headers.get(wire.TIMEOUT_HEADER, "0")),
        )
        metadata = [(wire.POD_KEY, route.pod)]
        metadata += [
            (key, headers[name]) for name, key in _METADATA_OF_HEADER.items() if name in headers
        ]
        future = self._stub(route.address).InvokeFunction.future(
            request, timeout=wait, metadata=metadata
        )
        with self._lock:
            self._calls.add(future)
        try:
            response = future.result()
            trailers = dict(future.trailing_metadata() or ())
        except grpc.FutureCancelledError:
            raise RequestCancelled(
                f"the call to {route.name} was cancelled", code="CANCELLED"
            ) from None
        except grpc.RpcError as err:
            raise self._failure(route, request.invocation_id, err) from None
        except BaseException:  # KeyboardInterrupt while waiting: the call goes with it
            future.cancel()
            raise
        finally:
            with self._lock:
                self._calls.discard(future)
        return _answered(response, trailers), response.output

    def cancel(self) -> int:
        """From another thread: cancel every call in flight; runtimed cancels each in turn (its
        handler is killed), as the gateway does when its caller goes away."""
        with self._lock:
            calls = list(self._calls)
        for call in calls:
            call.cancel()
        return len(calls)

    def close(self) -> None:
        with self._lock:
            channels, self._channels = self._channels, {}
        for channel, _ in channels.values():
            channel.close()

    def _stub(self, address: str) -> pb_grpc.FunctionRuntimeStub:
        with self._lock:
            if address not in self._channels:
                channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
                self._channels[address] = (channel, pb_grpc.FunctionRuntimeStub(channel))
            return self._channels[address][1]

    @staticmethod
    def _failure(route: Route, invocation_id: str, err: grpc.RpcError) -> Exception:
        call: Any = err
        code = call.code()
        if code in _NEVER_RAN or (
            # runtimed is not there (its pod restarted elsewhere, or stopped): never sent
            code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in (call.details() or "")
        ):
            return RouteGone(f"{code.name}: {call.details()}")
        body = failure_body(err)  # the gateway's own translation (docs/protocol.md, "Errors")
        body["message"] = body["message"].replace(f"run {route.run_uid}", f'"{route.name}"')
        body.update(runUid=route.run_uid, invocationId=invocation_id)
        return from_response(body, wire.http_status(body["code"]))


def _answered(response: pb.InvokeFunctionResponse, trailers: Mapping[str, Any]) -> dict[str, str]:
    """The headers the gateway answers a call with (gateway/invoke.py), from runtimed's answer."""
    reply = {
        "Content-Type": response.content_type or payloads.JSON,
        wire.INVOCATION_ID_HEADER: response.invocation_id,
        wire.OUTPUTS_HEADER: json.dumps(dict(response.outputs), sort_keys=True)
        if response.outputs
        else "{}",
        wire.ATTEMPT_HEADER: str(trailers.get(wire.ATTEMPT_KEY, "0")),
    }
    if trailers.get(wire.COLD_START_KEY) == "1":
        reply[wire.COLD_START_HEADER] = "1"
    if logs := trailer_logs(dict(trailers)):
        reply[wire.LOGS_HEADER] = json.dumps(logs)
    if ref := trailers.get(wire.OUTPUT_REF_KEY):
        reply[wire.OUTPUT_REF_HEADER] = str(ref)
    return reply
