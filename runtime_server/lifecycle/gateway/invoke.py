"""The gateway's hot path (docs/protocol.md, "HTTP API"): ``POST /v1/runs/NAME:invoke``, through
the assigned pod's runtimed (a replica set's least busy replica), with the call's timeline and
spans when asked.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable
from typing import Any

import grpc
import grpc.aio
from tornado.http1connection import HTTP1Connection

from fnkernel.adapters._payloads import JSON, MEDIA_TYPES
from fnkernel.runtime_server import limits, tracing, wire
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server.errors import (
    InvalidField,
    NoRuntimePod,
    RunNotReady,
    RunReplaced,
)
from fnkernel.runtime_server.function_runtime.spool import spool_dir
from fnkernel.runtime_server.lifecycle.gateway.access import accepts
from fnkernel.runtime_server.lifecycle.gateway.failures import (
    FailureResponse,
    all_busy,
    rpc_error,
)
from fnkernel.runtime_server.lifecycle.gateway.handlers import (
    BodyHandler,
    TracedHandler,
    header_text,
    metadata_of,
)
from fnkernel.runtime_server.lifecycle.gateway.payloads import Upload, discard_spooled, send_spooled
from fnkernel.runtime_server.lifecycle.runs import Run
from fnkernel.runtime_server.rpc import no_answer, trailer_logs
from fnkernel.runtime_server.wire import (
    ATTEMPT_KEY,
    COLD_START_KEY,
    INPUT_REF_KEY,
    OUTPUT_REF_FROM_KEY,
    OUTPUT_REF_KEY,
    POD_KEY,
    TIMELINE_KEY,
    TIMELINE_RUNTIMED_KEY,
    TIMELINE_SERVER_KEY,
    parse_timeline_stamps,
)


def _timeline(gateway: dict[str, int], trailers: dict[str, Any]) -> str:
    """The X-Fn-Timeline answer: each hop's monotonic clock readings, in ns (docs/protocol.md,
    "Timeline")."""
    hops = {"gateway": gateway}
    for hop, key in (("runtimed", TIMELINE_RUNTIMED_KEY), ("server", TIMELINE_SERVER_KEY)):
        hops[hop] = parse_timeline_stamps(str(trailers.get(key, "")))
    return json.dumps(hops, separators=(",", ":"))


# What bounds a body sent without a Content-Length (a chunked one) past one message.
WITHOUT_LENGTH = (
    " without a Content-Length (a larger body is streamed to the spool when it says its length)"
)


class InvokeHandler(TracedHandler, BodyHandler):
    """POST /v1/runs/{name}:invoke — the body is the payload, of one of the content types
    (docs/protocol.md, "Content types"; BodyHandler: bounded by MAX_PAYLOAD_BYTES, refused with
    413 before anything is looked up or called). A traced call's spans go back with its answer
    (TracedHandler)."""

    route = "/v1/runs/{name}:invoke"
    spans_handed_back = True
    bodies = MEDIA_TYPES

    def prepare(self) -> Awaitable[None] | None:
        self._received = time.monotonic_ns()  # the timeline's first reading (docs/protocol.md)
        self._call: grpc.aio.UnaryUnaryCall | None = None
        self._upload: Upload | None = None  # a body past one message, on its way to the spool
        self._upload_run: Run | None = None
        super().prepare()
        if not self._refused and self.content_length() > limits.MAX_PAYLOAD_BYTES:
            return self._start_upload(self.content_length())
        return None

    def largest_body(self) -> tuple[int, str]:
        return self.gateway.max_payload_bytes, limits.MAX_PAYLOAD_WHY

    def whole_body(self) -> tuple[int, str]:
        # Read whole: a body of one message, within the gateway's bound. A body sent without a
        # Content-Length (chunked) is read so; past one message it must say its length, to
        # be streamed to the spool.
        bound = self.gateway.max_payload_bytes
        if bound <= limits.MAX_PAYLOAD_BYTES:
            return bound, limits.MAX_PAYLOAD_WHY
        return limits.MAX_PAYLOAD_BYTES, WITHOUT_LENGTH

    async def _start_upload(self, length: int) -> None:
        """Stream the body into the spool of the pod that will run the call as it arrives
        (docs/protocol.md, "Large payloads"); a replica set's least busy free replica."""
        if self.request.headers.get(wire.INPUT_REF_HEADER):
            raise InvalidField(wire.INPUT_REF_HEADER, "names the input: the body must be empty")
        self._call_fields()  # a header that is wrong refused before the body is sent
        run = self._meant(self.path_args[0])
        if run.spec.replicas != 1 and not run.spec.replica_of:
            run = self.gateway.replicas(run)[0]
        _, address = self.gateway.pod_of(run)
        assert isinstance(self.request.connection, HTTP1Connection)
        self.request.connection.set_max_body_size(length)
        wait = self.gateway.body_timeout + limits.HOP_SLACK_SECONDS
        self._upload, self._upload_run = (
            Upload(self.gateway.payloads_stub(address), length, wait),
            run,
        )

    def _meant(self, name: str) -> Run:
        """The Run `name`; RunReplaced if the call names the uid of another (X-Fn-Run-Uid): the
        one it was meant for was deleted and this one made since."""
        run = self.gateway.store.get_fresh(name)
        meant = header_text(self.request.headers, wire.RUN_UID_HEADER)
        if meant and meant != run.uid:
            raise RunReplaced(
                f"run {name}: not the Run this call was meant for ({meant}): that one was "
                f"deleted, and this one ({run.uid}) made since; not called"
            )
        return run

    def data_received(self, chunk: bytes) -> Awaitable[None] | None:
        if self._upload is not None:
            return self._upload.write(chunk)  # waits while the pod's stream is full
        return super().data_received(chunk)

    def span_attributes(self) -> dict[str, Any]:
        return {
            tracing.RUN_NAME: self.path_kwargs.get("name") or next(iter(self.path_args), ""),
            tracing.INVOCATION_ID: self.request.headers.get(wire.INVOCATION_ID_HEADER, ""),
        }

    def on_connection_close(self) -> None:
        super().on_connection_close()
        # The client hung up (an interrupted notebook cell): cancel, so the handler is killed.
        if self._call is not None:
            self._call.cancel()
        if self._upload is not None:
            self._upload.cancel()

    async def _call_run(
        self,
        run: Run,
        payload: bytes,
        invocation_id: str,
        timeout_millis: int,
        timeline: bool,
        *,
        counted: bool,
        spooled: tuple[str, int] = ("", 0),
    ) -> tuple[pb.InvokeFunctionResponse, dict[str, Any], int] | None:
        """InvokeFunction on `run` through its pod's runtimed: the response, its trailers and
        when it was called; None if the client went away. `counted`: kept in the gateway's
        count of calls in flight (a replica set's)."""
        pod, stub = self.gateway.route(run)
        request = pb.InvokeFunctionRequest(
            registration=pb.FunctionRegistration(run_uid=run.uid),
            invocation_id=invocation_id,
            input=payload,
            content_type=self.request.headers.get("Content-Type", JSON),
            timeout_millis=timeout_millis,
        )
        deadline = limits.wait_seconds(timeout_millis, hops_below=1)  # runtimed
        metadata: tuple[tuple[str, str], ...] = ((POD_KEY, pod),)
        input_ref, output_from = spooled  # docs/protocol.md, "Large payloads"
        if input_ref:
            metadata += ((INPUT_REF_KEY, input_ref),)
        if output_from:
            metadata += ((OUTPUT_REF_FROM_KEY, str(output_from)),)
        if timeline:
            metadata += ((TIMELINE_KEY, "1"),)
        hop = self.hop
        if hop is not tracing.UNTRACED:
            hop.set(tracing.RUN_UID, run.uid)
            traceparent = hop.call(tracing.INVOKE_SPAN, tracing.rpc_attributes("InvokeFunction"))
            metadata += ((wire.TRACEPARENT_KEY, traceparent),)
        in_flight = self.gateway.in_flight
        if counted:
            in_flight[run.uid] = in_flight.get(run.uid, 0) + 1
            if invocation_id:
                self.gateway.remember_route(invocation_id, run.name)
        called = time.monotonic_ns()
        self._call = stub.InvokeFunction(request, timeout=deadline, metadata=metadata)
        try:
            response = await self._call
            trailers = metadata_of(await self._call.trailing_metadata())
        except grpc.aio.AioRpcError as err:
            if hop is not tracing.UNTRACED:
                spans = metadata_of(err.trailing_metadata()).get(wire.SPANS_KEY)
                hop.called(err.code().value[0], spans)
            failure = rpc_error(err, run, invocation_id)
            if failure.code == "DEADLINE_EXCEEDED" and not no_answer(
                err.code(), err.details() or ""
            ):
                # The handler's own deadline: how an HTTP caller gives it more.
                failure.extra["hint"] = (
                    f"give it more with the {wire.TIMEOUT_HEADER} header, in milliseconds"
                    f" (at most {limits.MAX_TIMEOUT_MILLIS})"
                )
            raise failure from None
        except asyncio.CancelledError:
            return None
        finally:
            if counted:
                left = in_flight.pop(run.uid, 1) - 1
                if left:
                    in_flight[run.uid] = left
        return response, trailers, called

    def _call_fields(self) -> tuple[str, int, int, bool]:
        """The call's invocation id, timeout and the size from which its result is spooled
        (and whether the caller takes it by reference), from the headers; InvalidField naming
        the header that is wrong."""
        headers = self.request.headers
        by_ref = header_text(headers, wire.OUTPUT_REF_FROM_HEADER)
        output_from = (
            limits.parse_count(by_ref, wire.OUTPUT_REF_FROM_HEADER) or 1
            if by_ref
            else limits.MAX_PAYLOAD_BYTES + 1
        )
        invocation_id = limits.check_invocation_id(header_text(headers, wire.INVOCATION_ID_HEADER))
        # Any int64 is taken, as on the wire, and capped like timeout_millis (limits.py).
        timeout_millis = limits.parse_count(
            header_text(headers, wire.TIMEOUT_HEADER, "0"), wire.TIMEOUT_HEADER
        )
        return invocation_id, timeout_millis, output_from, bool(by_ref)

    async def post(self, name: str) -> None:
        body_read = time.monotonic_ns()  # the whole body is in: the timeline's second reading
        # docs/protocol.md, "Large payloads": the input spooled as it came, or by a caller on
        # this machine; a result from the size it takes by reference, else past one message.
        input_ref, payload = header_text(self.request.headers, wire.INPUT_REF_HEADER), b""
        if self._upload is None:
            if not input_ref:
                payload = self.body()
            elif self.body():
                raise InvalidField(wire.INPUT_REF_HEADER, "names the input: the body must be empty")
            await self._invoke(name, input_ref, payload, body_read)
            return
        # The body the gateway spooled is the gateway's to remove, if its call never took it
        # (refused: busy, a bad header, a runtime that takes no such content); one that ran
        # has removed it, however it ended.
        input_ref = await self._upload.finish()
        called = False
        try:
            called = await self._invoke(name, input_ref, payload, body_read)
        finally:
            if not called:  # where it was written, whatever became of its Run since
                await discard_spooled(self._upload.stub, input_ref)

    async def _invoke(self, name: str, input_ref: str, payload: bytes, body_read: int) -> bool:
        """Call the Run `name` with the input `payload`, or the spooled `input_ref`, and answer
        the request: whether the call reached its Runtime Server and ended there (its input
        removed)."""
        headers = self.request.headers
        invocation_id, timeout_millis, output_from, by_ref = self._call_fields()
        spooled = (input_ref, output_from)
        run = self._meant(name)
        timeline = headers.get(wire.TIMELINE_HEADER) == "1"
        if self._upload_run is not None:  # its input is in that pod's spool
            run = self._upload_run
            answer = await self._call_run(
                run, payload, invocation_id, timeout_millis, timeline, counted=True, spooled=spooled
            )
        elif run.spec.replicas == 1 or run.spec.replica_of:
            answer = await self._call_run(
                run,
                payload,
                invocation_id,
                timeout_millis,
                timeline,
                counted=False,
                spooled=spooled,
            )
        else:
            # A replica set: the free replica that has the fewest calls in flight (docs/
            # protocol.md, "Replicas"); one busy with another gateway's call gives the next.
            candidates = self.gateway.replicas(run)
            for index, candidate in enumerate(candidates):
                last = index == len(candidates) - 1
                try:
                    answer = await self._call_run(
                        candidate, payload, invocation_id, timeout_millis, timeline,
                        counted=True, spooled=spooled,
                    )  # fmt: skip
                except (RunNotReady, NoRuntimePod):
                    if last:
                        raise
                    continue
                except FailureResponse as failure:
                    if failure.code != "RESOURCE_EXHAUSTED":
                        raise
                    if last:  # each busy with another caller's call: the function is
                        raise all_busy(run.name, len(candidates)) from None
                    continue
                run = candidate
                break
        if answer is None:  # the client went away: its call was cancelled
            self.abandon("CANCELLED: the client went away")
            return False
        response, trailers, called = answer
        if self.hop is not tracing.UNTRACED:
            self.hop.called(0, trailers.get(wire.SPANS_KEY))
            self.hop.set(tracing.INVOCATION_ID, response.invocation_id)
        media = response.content_type or JSON
        accept = headers.get("Accept", "")
        ref = str(trailers.get(OUTPUT_REF_KEY, ""))
        if not accepts(accept, media):
            if ref:  # nobody will take it
                stub = self.gateway.payloads_stub(self.gateway.pod_of(run)[1])
                await discard_spooled(stub, ref.split(" ", 1)[0])
            # The call ran: which one, as a failed call's answer says.
            raise FailureResponse(
                "NOT_ACCEPTABLE",
                status=406,
                message=f"the function returned {media}, which Accept {accept[:100]!r} does not "
                "take (the call ran; its result is not sent)",
                runUid=run.uid,
                invocationId=response.invocation_id,
            )
        self.set_header("Content-Type", media)
        self.set_header(wire.INVOCATION_ID_HEADER, response.invocation_id)
        outputs = json.dumps(dict(response.outputs), sort_keys=True) if response.outputs else "{}"
        self.set_header(wire.OUTPUTS_HEADER, outputs)
        self.set_header(wire.ATTEMPT_HEADER, str(trailers.get(ATTEMPT_KEY, run.status.attempt)))
        if run.spec.replicas != 1:
            self.set_header(wire.RUN_HEADER, run.name)
        if trailers.get(COLD_START_KEY) == "1":
            self.set_header(wire.COLD_START_HEADER, "1")
        logs = trailer_logs(trailers)
        if logs:  # json.dumps writes ASCII: non-ASCII text is \u-escaped
            self.set_header(wire.LOGS_HEADER, json.dumps(logs))
        if timeline:
            readings = {
                "received": self._received,
                "body": body_read,
                "called": called,
                "answered": time.monotonic_ns(),
            }
            self.set_header(wire.TIMELINE_HEADER, _timeline(readings, trailers))
        if not ref:
            self.finish(response.output)
        elif by_ref:  # the caller reads it from the spool itself
            self.set_header(wire.OUTPUT_REF_HEADER, ref)
            self.finish(b"")
        else:
            out, size = ref.split(" ", 1)
            if self.gateway.spool is not None:  # a caller on this machine may take it from there
                self.set_header(wire.SPOOL_HEADER, str(spool_dir(self.gateway.spool)))
            stub = self.gateway.payloads_stub(self.gateway.pod_of(run)[1])
            await send_spooled(self, stub, out, int(size))
        return True
