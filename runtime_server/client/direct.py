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
import queue
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from fnkernel.adapters.errors import InvocationCancelled
from fnkernel.runtime_server import callstream, payloads, wire
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import batches_pb2, batches_pb2_grpc
from fnkernel.runtime_server.client.errors import GatewayError, RequestCancelled, from_response
from fnkernel.runtime_server.client.views import InvocationResult
from fnkernel.runtime_server.rpc import (
    STREAM_CHANNEL_OPTIONS,
    CancellableCalls,
    failure_body,
    metadata_pairs,
    never_sent,
    status_body,
    status_code,
    trailer_logs,
)

# What the gateway's HTTP headers carry, as the metadata it sends runtimed (gateway/invoke.py).
_METADATA_OF_HEADER = {
    wire.INPUT_REF_HEADER: wire.INPUT_REF_KEY,
    wire.OUTPUT_REF_FROM_HEADER: wire.OUTPUT_REF_FROM_KEY,
}

# Refusals that come before the call is dispatched (the Run is not there, or not routed to that
# pod): the call never ran, so it is made again through the gateway, which knows where it is.
_NEVER_RAN = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION})
# How a batch ends when its next item was never called (docs/protocol.md, "Batches"): besides
# those, another caller's call is in flight on the Run, or its server is going away.
_NOT_CALLED = _NEVER_RAN | {grpc.StatusCode.RESOURCE_EXHAUSTED}


@dataclass(frozen=True)
class Route:
    """Where the Run `name` is called on this machine: runtimed at `address`, on `pod`."""

    name: str
    run_uid: str
    pod: str
    address: str

    @classmethod
    def of(cls, name: str, found: Mapping[str, str]) -> Route:
        """The route the gateway names in ``GET /v1/runs/NAME:route`` (`route`, or one of
        `replicas`)."""
        return cls(name, found["runUid"], found["pod"], found["runtimed"])


class RouteGone(Exception):
    """The route no longer leads to the Run (moved, replaced, its pod gone) and the call was
    not made: make it through the gateway."""


class Direct:
    """The channels to this machine's runtimeds, and the calls in flight on them (``cancel``)."""

    def __init__(self, sharing: Direct | None = None) -> None:
        self._lock = threading.Lock()
        # Per runtimed: its invokes, each blocking on a channel of its own that ``cancel``
        # closes (a future's answer comes through another thread: ~0.2 ms a call).
        self._invokes: dict[str, CancellableCalls[callstream.Invoke]] = {}
        # The batches' channels, `sharing`'s if given (a map's own, its client's: cancelling a
        # batch cancels its call, never the channel, which then need not connect anew).
        self._channels: dict[str, grpc.Channel] = sharing._channels if sharing else {}
        self._batches: dict[str, batches_pb2_grpc.BatchesStub] = sharing._batches if sharing else {}
        self._channels_lock: threading.Lock = (
            sharing._channels_lock if sharing else threading.Lock()
        )
        self._owns_channels = sharing is None
        self._calls: set[Any] = set()  # the batches in flight

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
        try:
            answer, call = self._invokes_of(route.address).call(
                lambda invoke: invoke.with_call(
                    request.SerializeToString(), timeout=wait, metadata=metadata
                )
            )
        except InvocationCancelled:
            raise RequestCancelled(
                f"the call to {route.name} was cancelled", code="CANCELLED"
            ) from None
        except grpc.RpcError as err:
            raise self._failure(route, request.invocation_id, err) from None
        response = pb.InvokeFunctionResponse.FromString(answer)
        return _answered(response, dict(call.trailing_metadata() or ())), response.output

    def invoke_batch(
        self,
        route: Route,
        items: Sequence[tuple[str, bytes, str]],
        timeout_millis: int,
        go_on: bool,
        wait: float,
        refill_at: int = 0,
        last: bool = True,
    ) -> BatchCall:
        """Batches/InvokeBatch on `route` (docs/protocol.md, "Batches") with `items`, each its
        invocation ID, input and content type, to be followed by more (``BatchCall.more``)
        until ``BatchCall.done``, unless `last`; `wait`: the whole batch's deadline,
        `refill_at` and `last`: as the request's."""
        first = batches_pb2.InvokeBatchRequest(
            run_uid=route.run_uid,
            items=_batch_items(items),
            timeout_millis=timeout_millis,
            go_on=go_on,
            refill_at=refill_at,
            last=last,
        )
        sending: queue.SimpleQueue[batches_pb2.InvokeBatchRequest | None] = queue.SimpleQueue()

        def requests() -> Iterator[batches_pb2.InvokeBatchRequest]:
            yield first
            while not last and (message := sending.get()) is not None:
                yield message

        answers = self._batches_stub(route.address).InvokeBatch(
            requests(), timeout=wait, metadata=((wire.POD_KEY, route.pod),)
        )
        with self._lock:
            self._calls.add(answers)
        return BatchCall(self, route, answers, sending, [item[0] for item in items])

    def cancel(self) -> int:
        """From another thread: cancel every call in flight; runtimed cancels each in turn (its
        handler is killed), as the gateway does when its caller goes away."""
        with self._lock:
            calls, invokes = list(self._calls), list(self._invokes.values())
        for call in calls:
            call.cancel()
        return len(calls) + sum(invoke.cancel() for invoke in invokes)

    def forget(self, call: Any) -> None:
        """The batch `call` is over: ``cancel`` no longer reaches it."""
        with self._lock:
            self._calls.discard(call)

    def close(self) -> None:
        with self._lock:
            invokes, self._invokes = self._invokes, {}
        channels: list[grpc.Channel] = []
        if self._owns_channels:
            with self._channels_lock:
                channels = list(self._channels.values())
                self._channels.clear()
                self._batches.clear()
        for channel in channels:
            channel.close()
        for invoke in invokes.values():
            invoke.close()

    def _invokes_of(self, address: str) -> CancellableCalls[callstream.Invoke]:
        with self._lock:
            if address not in self._invokes:
                streams_at = wire.call_streams_target(address)  # runtimed's, on an event loop
                self._invokes[address] = CancellableCalls(
                    address, lambda channel: callstream.Invoke(channel, streams_at)
                )
            return self._invokes[address]

    def _batches_stub(self, address: str) -> batches_pb2_grpc.BatchesStub:
        with self._channels_lock:
            if address not in self._batches:
                channel = grpc.insecure_channel(address, options=STREAM_CHANNEL_OPTIONS)
                self._channels[address] = channel
                self._batches[address] = batches_pb2_grpc.BatchesStub(channel)
            return self._batches[address]

    @classmethod
    def _failure(
        cls, route: Route, invocation_id: str, err: grpc.RpcError
    ) -> RouteGone | GatewayError:
        if err.code() in _NEVER_RAN or _never_sent(err):
            return RouteGone(f"{err.code().name}: {err.details()}")
        # the gateway's own translation (docs/protocol.md, "Errors")
        return cls._error(route, invocation_id, failure_body(err))

    @staticmethod
    def _error(route: Route, invocation_id: str, body: dict[str, Any]) -> GatewayError:
        body["message"] = body["message"].replace(f"run {route.run_uid}", f'"{route.name}"')
        body.update(runUid=route.run_uid, invocationId=invocation_id)
        return from_response(body, wire.http_status(body["code"]))


class BatchCall:
    """One batch in flight (``Direct.invoke_batch``): items sent on with ``more`` until ``done``,
    its answers read from ``answers``; ``close`` ends it, cancelling what is left."""

    def __init__(
        self,
        direct: Direct,
        route: Route,
        answers: Any,
        sending: queue.SimpleQueue[batches_pb2.InvokeBatchRequest | None],
        invocation_ids: list[str],
    ) -> None:
        self._direct = direct
        self._route = route
        self._answers = answers
        self._sending = sending
        self._invocation_ids = invocation_ids  # every item's sent, by its index
        self._done = False
        self.message_read = False  # the answer ``answers`` gave last was its message's last

    def more(
        self, items: Sequence[tuple[str, bytes, str]], refill_at: int, *, last: bool = False
    ) -> None:
        """Send `items` on, numbered after those before; `refill_at` and `last`: as the
        request's (``done`` follows a `last`)."""
        self._invocation_ids += [item[0] for item in items]
        message = batches_pb2.InvokeBatchRequest(
            items=_batch_items(items), refill_at=refill_at, last=last
        )
        self._sending.put(message)
        if last:
            self.done()

    def done(self) -> None:
        """Nothing more will be sent: the batch ends once every item sent is answered."""
        if not self._done:
            self._done = True
            self._sending.put(None)

    def answers(self) -> Iterator[tuple[int, InvocationResult | GatewayError]]:
        """Each item's answer as it comes, by its index: its result, or the gateway's error for
        its failure. When the batch ends before every item sent was answered, the rest were
        never called: RouteGone if that is because the route no longer leads to the Run or
        another caller's call is in flight there (RESOURCE_EXHAUSTED); RequestCancelled if
        ``Direct.cancel`` stopped it; else the batch was cut off, and each item not answered
        fails with its error (it may have run)."""
        route, answered = self._route, 0
        started = time.perf_counter()
        try:
            for message in self._answers:
                last = len(message.answers) - 1
                for place, answer in enumerate(message.answers):
                    self.message_read = place == last
                    answered = answer.index + 1
                    trailers = dict(metadata_pairs(answer.trailers))
                    if answer.code:
                        code = status_code(answer.code)
                        body = status_body(code, answer.message, trailers)
                        yield answer.index, Direct._error(route, answer.invocation_id, body)
                    else:
                        reply = _answered(answer, trailers)
                        yield answer.index, InvocationResult.answered(reply, answer.output, started)
                    started = time.perf_counter()
        except grpc.RpcError as err:
            if self._answers.cancelled():
                raise RequestCancelled(
                    f"the batch to {route.name} was cancelled", code="CANCELLED"
                ) from None
            if err.code() in _NOT_CALLED or _never_sent(err):
                raise RouteGone(f"{err.code().name}: {err.details()}") from None
            # Cut off (a process of the hop died): the item that ran has no answer, and the
            # items after it may have run too — answers are held up to 100 ms, and the worker
            # may have begun the one queued behind — so each fails, and none is called again.
            body = failure_body(err)
            for index in range(answered, len(self._invocation_ids)):
                yield index, Direct._error(route, self._invocation_ids[index], dict(body))

    def close(self) -> None:
        """A caller that stops reading: the rest are not called."""
        self.done()
        self._answers.cancel()
        self._direct.forget(self._answers)


def _batch_items(items: Sequence[tuple[str, bytes, str]]) -> list[batches_pb2.BatchItem]:
    return [
        batches_pb2.BatchItem(invocation_id=invocation_id, input=data, content_type=media)
        for invocation_id, data, media in items
    ]


def _never_sent(err: grpc.RpcError) -> bool:
    """runtimed is not there (its pod restarted elsewhere, or stopped): the call never left."""
    call: Any = err
    return never_sent(call.code(), call.details() or "")


def _answered(
    response: pb.InvokeFunctionResponse | batches_pb2.BatchAnswer, trailers: Mapping[str, Any]
) -> dict[str, str]:
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
