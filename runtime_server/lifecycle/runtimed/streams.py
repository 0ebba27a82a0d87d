"""runtimed's call streams on an event loop (docs/architecture.md, "Call streams";
docs/protocol.md, "Call streams").

A caller on this machine sends its InvokeFunction calls to runtimed as the messages of
``CallStreams/InvokeFunctions`` streams. Served by grpcio's thread pool, each message crosses four
threads in runtimed — the polling thread, the stream's, the one grpc sends upstream from, the
channel's that reads the answer — and runtimed was the largest part of a call's CPU. Here one
event loop (grpc.aio, on a thread of its own) reads the message, relays it upstream on a stream
to the Runtime Server and writes the answer back, with no thread between them, on a socket of
its own (``wire.call_streams_target``). The rest of runtimed — the gateway's unary calls,
batches, live output, the spool — stays on grpcio's server.

Each call is relayed as ``ProxyServicer`` relays the unary one, through the same steps
(``proxy``: the routing fence, the registration filled in, the deadline bound, the trailers), in
the same call pipeline (its span and timeline, its failures as statuses, counted in flight for a
stop). What may wait — a registration on demand (``Runtimed.resolve``'s slow path), what a
failure tells runtimed — runs on a thread, never on the loop.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator, Callable
from concurrent import futures
from typing import Any, TypeVar

import grpc

from fnkernel.runtime_server import callstream, limits
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import callstreams_pb2 as cs
from fnkernel.runtime_server.lifecycle.runs import Run
from fnkernel.runtime_server.lifecycle.runtimed.proxy import (
    PROXY_THREADS,
    ProxyServicer,
    RelayedInvoke,
    invoked_run,
    relay_answered,
    relay_failed,
    relayed,
)
from fnkernel.runtime_server.lifecycle.runtimed.server import Active
from fnkernel.runtime_server.pipeline import Pipeline, ServedCall
from fnkernel.runtime_server.rpc import (
    CHANNEL_OPTIONS,
    HOP_CHANNEL_OPTIONS,
    caller_timeout,
    listen_on,
    metadata_value,
)
from fnkernel.runtime_server.wire import POD_KEY

T = TypeVar("T")


class StreamRelay:
    """runtimed's ``CallStreams/InvokeFunctions`` on grpc.aio: `proxy`'s relay of InvokeFunction
    to its Runtime Server at `server_address`, each call in `pipeline` (runtimed's)."""

    def __init__(self, proxy: ProxyServicer, pipeline: Pipeline, server_address: str) -> None:
        self._proxy = proxy
        self._runtimed = proxy.runtimed
        self._pipeline = pipeline
        self._server_address = server_address
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="call-streams", daemon=True
        )
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None
        self._invoke: callstream.AsyncInvoke | None = None
        self._stopping: asyncio.Future[None] | None = None
        # What may wait, off the loop: as many cold starts at once as runtimed's other port
        # serves calls (the threads are made as they are needed).
        self._waits = futures.ThreadPoolExecutor(PROXY_THREADS, thread_name_prefix="stream-waits")
        self._open = 0  # streams open (read and written on the loop only)

    # Lifecycle, from runtimed's thread

    def start(self, listen: str) -> str:
        """Serve on `listen`: the address bound. RuntimeError if it cannot be."""
        self._thread.start()
        try:
            return self._on_loop(self._serve(listen))
        except BaseException:
            self.close()
            raise

    def refuse(self, grace: float) -> None:
        """Take no new streams; those open are cut off after `grace` seconds at the latest
        (``close`` cuts them off sooner: runtimed's pipeline waits for the calls in flight,
        not for streams open with none)."""
        server = self._server
        if server is not None and self._stopping is None and self._thread.is_alive():

            async def stopping() -> asyncio.Future[None]:
                return asyncio.ensure_future(server.stop(grace))

            self._stopping = self._on_loop(stopping())

    def close(self) -> None:
        """Cut off what is left, and end the loop and its thread (once: a repeat does nothing)."""
        if self._thread.is_alive():
            self._on_loop(self._closed())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            if not self._thread.is_alive():
                self._loop.close()
        self._server = None
        self._waits.shutdown(wait=False, cancel_futures=True)

    def _on_loop(self, work: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result()

    async def _serve(self, listen: str) -> str:
        self._channel = grpc.aio.insecure_channel(self._server_address, options=HOP_CHANNEL_OPTIONS)
        self._invoke = callstream.AsyncInvoke(self._channel)
        server = grpc.aio.server(options=CHANNEL_OPTIONS)
        calls = grpc.stream_stream_rpc_method_handler(
            self._calls,
            request_deserializer=cs.StreamedCall.FromString,
            response_serializer=cs.StreamedAnswer.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(callstream.SERVICE, {"InvokeFunctions": calls}),)
        )
        address = listen_on(server, listen)
        await server.start()
        self._server = server
        return address

    async def _closed(self) -> None:
        if self._server is not None:
            await self._server.stop(None)
        if self._stopping is not None:
            await self._stopping
        if self._invoke is not None:
            self._invoke.close()
        if self._channel is not None:
            await self._channel.close(None)

    # The calls, on the loop

    async def _calls(
        self, messages: AsyncIterator[cs.StreamedCall], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[cs.StreamedAnswer]:
        """One stream: each call answered before the next is read."""
        if self._open >= limits.MAX_LOOP_CALL_STREAMS:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, callstream.STREAMS_FULL)
        self._open += 1
        try:
            async for message in messages:
                with self._pipeline.in_flight():  # until its answer is sent
                    yield await self._answer(message, context)
        finally:
            self._open -= 1

    async def _answer(
        self, message: cs.StreamedCall, context: grpc.aio.ServicerContext
    ) -> cs.StreamedAnswer:
        call = callstream.CallContext(lambda: not context.done(), message)
        request = RelayedInvoke(message.request)
        served = self._pipeline.serving(request, call)
        try:
            response = await self._invoked(request, call, served)
        except Exception as exc:
            code, details, trailers = self._pipeline.failure(served, exc)
            return callstream.streamed_answer(None, trailers, code, details)
        served.answer()  # this hop's trailers, with the server's, into the call's
        return callstream.streamed_answer(response, call.trailers)

    async def _invoked(
        self, request: RelayedInvoke, call: callstream.CallContext, served: ServedCall
    ) -> bytes:
        """``ProxyServicer.InvokeFunction``, on the loop."""
        run_uid = invoked_run(request)
        routed_to = metadata_value(call, POD_KEY)
        found = self._runtimed.ready(run_uid, routed_to)
        if found is not None:
            run, active, cold = *found, False
        else:  # registered on demand, or not ready: it may wait
            run, active, cold = await self._waited(self._runtimed.resolve, run_uid, routed_to)
        try:
            return await self._forward(request, call, served, run, active, cold)
        except grpc.RpcError as err:
            failed = functools.partial(self._proxy.upstream_failed, caller_there=call.is_active())
            await self._waited(failed, err, request, run, active)
        again = functools.partial(self._runtimed.resolve, fast=False)
        run, active, cold = await self._waited(again, run_uid, routed_to)
        return await self._forward(request, call, served, run, active, cold)

    async def _forward(
        self,
        request: RelayedInvoke,
        call: callstream.CallContext,
        served: ServedCall,
        run: Run,
        active: Active,
        cold: bool,
    ) -> bytes:
        """``ProxyServicer._forward``, on the loop: the server's answer, as it sent it. A call
        whose caller goes away is cancelled here (its task is), and so its stream upstream:
        the server kills its handler."""
        assert self._invoke is not None
        timeout = caller_timeout(call)
        forwarded, upstream = relayed(request, timeout, active, served)
        try:
            response, trailers = await self._invoke.with_call(forwarded, timeout, upstream)
        except grpc.RpcError as err:
            relay_failed(served, err)
            raise
        relay_answered(served, trailers, active, cold)
        self._runtimed.served(run, active)
        return response

    async def _waited(self, work: Callable[..., T], *args: Any) -> T:
        return await self._loop.run_in_executor(self._waits, work, *args)
