"""Payloads past one message at the gateway (docs/protocol.md, "Large payloads"): a request body
streamed into the pod's spool as it arrives (``Upload``), a spooled result streamed out to the
caller (``send_spooled``), and ``GET /v1/payloads``, which tells a caller on this machine where
it may hand its own over as files. The gateway never holds a whole large payload: at most a
chunk of it, and what gRPC's flow control lets be in flight.
"""

from __future__ import annotations

from typing import Any

import grpc

from fnkernel.runtime_server import limits
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import payloads_pb2, payloads_pb2_grpc
from fnkernel.runtime_server.function_runtime.spool import CHUNK_BYTES, spool_dir
from fnkernel.runtime_server.lifecycle.gateway.handlers import BaseHandler

DISCARD_SECONDS = 10.0  # how long dropping a spooled payload may take (``discard_spooled``)


class Upload:
    """A request body of `size` bytes, written to a pod's spool by PutPayload as it arrives, in
    messages of up to CHUNK_BYTES."""

    def __init__(self, stub: payloads_pb2_grpc.PayloadsStub, size: int, timeout: float) -> None:
        self.stub = stub  # the pod's Payloads, where the body goes
        self.size = size
        self._call: Any = stub.PutPayload(timeout=timeout)
        self._buffer = bytearray()
        self._first = True

    async def write(self, chunk: bytes) -> None:
        self._buffer += chunk
        if len(self._buffer) >= CHUNK_BYTES:
            await self._send()

    async def _send(self) -> None:
        data, self._buffer = bytes(self._buffer), bytearray()
        size, self._first = (self.size if self._first else 0), False
        await self._call.write(payloads_pb2.PayloadChunk(size=size, data=data))

    async def finish(self) -> str:
        """The spooled payload's name, once all of it is there."""
        if self._buffer or self._first:
            await self._send()
        await self._call.done_writing()
        ref = await self._call
        return str(ref.name)

    def cancel(self) -> None:
        self._call.cancel()  # the spool removes what it had of it


async def send_spooled(
    handler: BaseHandler, stub: payloads_pb2_grpc.PayloadsStub, name: str, size: int
) -> None:
    """Answer the spooled result `name` of `size` bytes as the body, chunk by chunk, each sent
    before the next is read (TakePayload removes it from the spool)."""
    handler.set_header("Content-Length", str(size))
    # Cut short (the pod went away), tornado closes the connection: the caller sees a short body.
    # The caller gone mid-body, the call is cancelled, and the spool removes the rest.
    call = stub.TakePayload(payloads_pb2.PayloadRef(name=name))
    try:
        async for chunk in call:
            handler.write(chunk.data)
            await handler.flush()
    finally:
        call.cancel()
    handler.finish()


async def discard_spooled(stub: payloads_pb2_grpc.PayloadsStub, name: str) -> None:
    """Drop the spooled payload `name`, so that it does not wait in the spool's memory for the
    sweep: a result the caller will not read (its Accept refused it), an input whose call was
    refused before it ran. Its first chunk is taken and the rest refused: a take cut short
    removes the payload. Gone already (its call ran, and ended): nothing to do."""
    call = stub.TakePayload(payloads_pb2.PayloadRef(name=name), timeout=DISCARD_SECONDS)
    try:
        await call.read()
    except grpc.aio.AioRpcError:
        pass  # not there any more, or its pod went away with its spool
    finally:
        call.cancel()


class PayloadsHandler(BaseHandler):
    """GET /v1/payloads: the bounds of a payload, and where a caller on this machine hands one
    over as a file (``spool``: null where none can, on Kubernetes)."""

    def get(self) -> None:
        spool = self.gateway.spool
        self.send_json(200, {
            "spool": str(spool_dir(spool)) if spool is not None else None,
            "maxBytes": self.gateway.max_payload_bytes,
            "messageBytes": limits.MAX_PAYLOAD_BYTES,
            "spoolFromBytes": limits.SPOOL_FROM_BYTES,
        })  # fmt: skip
