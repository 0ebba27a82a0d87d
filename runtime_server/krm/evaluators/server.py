"""FunctionEvaluator over gRPC (docs/protocol.md, "FunctionEvaluator"): the servicer in front of any Evaluator, and the client
that makes a remote FunctionEvaluator an Evaluator again.

Errors map to status codes in one table. A failed function is INTERNAL, with its structured
results listed in the message (``[severity] apiVersion/kind/namespace/name field: message``) and
kept whole in the trailing metadata ``fn-results-bin`` (the results as a ResourceList, YAML), so a
caller keeps the structure.
"""

from __future__ import annotations

import logging
import time
from concurrent import futures
from typing import Any

import grpc

from fnkernel.runtime_server import limits, wire
from fnkernel.runtime_server._proto.evaluator.v1 import evaluator_pb2 as pb
from fnkernel.runtime_server._proto.evaluator.v1 import evaluator_pb2_grpc as pb_grpc
from fnkernel.runtime_server.errors import (
    DeadlineExceeded,
    EvaluatorError,
    EvaluatorSystemError,
    FunctionError,
    InvalidEvaluateRequest,
    NotFoundError,
)
from fnkernel.runtime_server.krm.evaluators.base import EvalRequest, EvalResponse, Evaluator
from fnkernel.runtime_server.krm.resources import resourcelist
from fnkernel.runtime_server.krm.resources.resourcelist import format_result
from fnkernel.runtime_server.rpc import (
    CHANNEL_OPTIONS,
    add_health,
    add_reflection,
    caller_deadline,
    listen_on,
    status_of,
)
from fnkernel.runtime_server.wire import EVALUATOR_KEY, EXIT_CODE_KEY, RESULTS_KEY

LOG = logging.getLogger("fnkernel.evaluator")
SERVICE = "evaluator.FunctionEvaluator"

# What a FunctionEvaluator status stands for, read back by a client (wire.GRPC_STATUS, backwards).
_ERROR_OF_STATUS = {
    wire.GRPC_STATUS[kind]: kind
    for kind in (
        NotFoundError,
        InvalidEvaluateRequest,
        FunctionError,
        DeadlineExceeded,
        EvaluatorSystemError,
    )
}


# A status message travels in a header; a client refuses headers over 8 KiB in all.
_MAX_MESSAGE_BYTES = 4096


def failure_message(error: FunctionError) -> str:
    lines = [str(error)]
    lines += [format_result(result) for result in error.results]
    if error.stderr.strip():
        lines.append(f"stderr: {error.stderr.strip()[-1000:]}")
    return "\n".join(lines)


def results_document(results: list[dict[str, Any]]) -> bytes:
    return resourcelist.ResourceList.of([], results=results).to_bytes()


class FunctionEvaluatorServicer(pb_grpc.FunctionEvaluatorServicer):
    def __init__(self, evaluator: Evaluator, max_bytes: int = limits.MAX_PAYLOAD_BYTES) -> None:
        self.evaluator = evaluator
        self.max_bytes = max_bytes

    def EvaluateFunction(
        self, request: pb.EvaluateFunctionRequest, context: grpc.ServicerContext
    ) -> pb.EvaluateFunctionResponse:
        if len(request.resource_list) > self.max_bytes:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"resource_list: {len(request.resource_list)} bytes is over the limit of "
                f"{self.max_bytes} bytes (6 MiB by default)",
            )
        deadline = caller_deadline(context)
        call = EvalRequest(request.resource_list, request.image, request.tag, request.exec_path)
        try:
            response = self.evaluator.evaluate(call, deadline)
        except EvaluatorError as error:
            code = status_of(error) or grpc.StatusCode.INTERNAL
            if isinstance(error, FunctionError):
                context.set_trailing_metadata(
                    (
                        (RESULTS_KEY, results_document(error.results)),
                        (EXIT_CODE_KEY, str(error.exit_code)),
                    )
                )
                context.abort(code, limits.bounded(failure_message(error), _MAX_MESSAGE_BYTES))
            context.abort(code, limits.bounded(str(error), _MAX_MESSAGE_BYTES))
        if response.evaluator:
            context.send_initial_metadata(((EVALUATOR_KEY, response.evaluator),))
        return pb.EvaluateFunctionResponse(resource_list=response.resource_list, log=response.log)


def serve(
    evaluator: Evaluator,
    listen: str,
    *,
    max_workers: int = 16,
    max_bytes: int = limits.MAX_PAYLOAD_BYTES,
) -> tuple[grpc.Server, str]:
    """A started FunctionEvaluator server (with health and reflection) and its bound address;
    health answers SERVING from the moment it listens."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="evaluate"),
        options=CHANNEL_OPTIONS,
    )
    servicer = FunctionEvaluatorServicer(evaluator, max_bytes)
    pb_grpc.add_FunctionEvaluatorServicer_to_server(servicer, server)
    add_health(server, [SERVICE])
    add_reflection(server, [SERVICE])
    address = listen_on(server, listen)
    server.start()
    return server, address


class RemoteEvaluator:
    """A FunctionEvaluator server (the evaluator server, a wrapper server) as an Evaluator."""

    def __init__(self, address: str, name: str = "remote") -> None:
        self.address = address
        self.name = name
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.FunctionEvaluatorStub(self._channel)

    def evaluate(self, request: EvalRequest, deadline: float | None = None) -> EvalResponse:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        message = pb.EvaluateFunctionRequest(
            resource_list=request.serialized(),
            image=request.image,
            tag=request.tag,
            exec_path=request.exec_path,
        )
        try:
            reply, call = self._stub.EvaluateFunction.with_call(message, timeout=timeout)
        except grpc.RpcError as err:
            raise error_of(err, request.image) from None
        served = dict(call.initial_metadata() or ()).get(EVALUATOR_KEY, "")
        return EvalResponse(reply.resource_list, reply.log, str(served) or self.name)

    def close(self) -> None:
        self._channel.close()


def error_of(err: grpc.RpcError, image: str) -> EvaluatorError:
    """A FunctionEvaluator status as the evaluator error it stands for."""
    code: grpc.StatusCode = err.code()
    details: str = err.details() or ""
    if code == grpc.StatusCode.INTERNAL:
        metadata: Any = err.trailing_metadata() or ()
        trailers = {key: value for key, value in metadata}
        raw = trailers.get(RESULTS_KEY)
        results = []
        if isinstance(raw, bytes):
            try:
                parsed = resourcelist.ResourceList.parse(raw)
                results = [dict(r) for r in parsed.results if isinstance(r, dict)]
            except (resourcelist.InvalidResourceList, ValueError):
                results = []
        exit_code = int(trailers.get(EXIT_CODE_KEY, "1") or 1)
        first = details.splitlines()[0] if details else f"{image} failed"
        return FunctionError(first, exit_code=exit_code, results=results, stderr=details)
    kind = _ERROR_OF_STATUS.get(code.name)
    if kind is not None:
        return kind(details)
    return EvaluatorSystemError(f"{image}: {code.name}: {details}")
