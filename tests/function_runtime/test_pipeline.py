"""A gRPC server's call pipeline, ``pipeline.Pipeline`` (docs/architecture.md, "One call pipeline per
hop"): tried on a server of its own, with handlers that do only their part."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import logs_pb2, logs_pb2_grpc
from fnkernel.runtime_server.errors import InvalidField
from fnkernel.runtime_server.pipeline import Pipeline, served_call
from fnkernel.runtime_server.rpc import trailer_value
from fnkernel.runtime_server.wire import TIMELINE_KEY, TIMELINE_SERVER_KEY, parse_timeline_stamps

FUNCTION_RUNTIME = pb.DESCRIPTOR.services_by_name["FunctionRuntime"].full_name


class Handlers(pb_grpc.FunctionRuntimeServicer):
    def InvokeFunction(self, request: Any, context: Any) -> Any:
        if request.invocation_id == "bad":
            raise InvalidField("input", "not what this handler takes")
        if request.invocation_id == "boom":
            raise RuntimeError("a bug")
        served_call().trailers = (("fn-handler", "its own"),)
        return pb.InvokeFunctionResponse(output=request.input)


class Logs(logs_pb2_grpc.InvocationLogsServicer):
    def FollowInvocationLogs(self, request: Any, context: Any) -> Iterator[Any]:
        yield logs_pb2.InvocationLogRecord()
        raise InvalidField("run_uid", "gone mid-stream")


@pytest.fixture
def channel(tmp_path: Path) -> Iterator[grpc.Channel]:
    # InvocationLogs is left out of the pipeline's services: its errors are grpc's to answer.
    pipeline = Pipeline(
        [FUNCTION_RUNTIME], component="runtime-server", timeline_key=TIMELINE_SERVER_KEY
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[pipeline])
    pb_grpc.add_FunctionRuntimeServicer_to_server(Handlers(), server)
    logs_pb2_grpc.add_InvocationLogsServicer_to_server(Logs(), server)
    address = f"unix:{tmp_path}/pipeline.sock"
    server.add_insecure_port(address)
    server.start()
    try:
        with grpc.insecure_channel(address) as channel:
            yield channel
    finally:
        server.stop(None)


def test_an_invoke_answers_with_the_handlers_trailers_and_the_hops_own_in_one_batch(
    channel: grpc.Channel,
) -> None:
    # The pipeline begins the ServedCall before the handler and answers it after: the
    # handler's trailer and the timeline it was asked for arrive together, twice in a row (the
    # wrapped handler is kept, not rebuilt).
    stub = pb_grpc.FunctionRuntimeStub(channel)
    for _ in range(2):
        response, call = stub.InvokeFunction.with_call(
            pb.InvokeFunctionRequest(input=b"{}"), metadata=((TIMELINE_KEY, "1"),), timeout=10
        )
        trailers = call.trailing_metadata()
        assert response.output == b"{}"
        assert trailer_value(trailers, "fn-handler") == "its own"
        stamps = parse_timeline_stamps(trailer_value(trailers, TIMELINE_SERVER_KEY))
        assert set(stamps) == {"received", "answered"}
        assert stamps["received"] <= stamps["answered"]


def test_a_call_not_asking_for_the_timeline_gets_none(channel: grpc.Channel) -> None:
    _, call = pb_grpc.FunctionRuntimeStub(channel).InvokeFunction.with_call(
        pb.InvokeFunctionRequest(input=b"{}"), timeout=10
    )
    assert trailer_value(call.trailing_metadata(), TIMELINE_SERVER_KEY) is None


def test_an_error_a_handler_raises_is_answered_with_its_status(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        pb_grpc.FunctionRuntimeStub(channel).InvokeFunction(
            pb.InvokeFunctionRequest(invocation_id="bad"), timeout=10
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "input: not what this handler takes"


def test_an_invokes_unexpected_error_is_internal_and_logged_under_its_name(
    channel: grpc.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        pb_grpc.FunctionRuntimeStub(channel).InvokeFunction(
            pb.InvokeFunctionRequest(invocation_id="boom"), timeout=10
        )
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert "internal error in InvokeFunction" in caplog.text


def test_a_service_outside_the_pipeline_is_left_as_grpc_serves_it(
    channel: grpc.Channel,
) -> None:
    records = logs_pb2_grpc.InvocationLogsStub(channel).FollowInvocationLogs(
        logs_pb2.FollowInvocationLogsRequest(), timeout=10
    )
    with pytest.raises(grpc.RpcError) as caught:
        list(records)
    assert caught.value.code() == grpc.StatusCode.UNKNOWN  # not our INVALID_ARGUMENT


def test_a_streaming_method_of_the_pipeline_has_its_errors_answered_as_statuses(
    tmp_path: Path,
) -> None:
    logs_service = logs_pb2.DESCRIPTOR.services_by_name["InvocationLogs"].full_name
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2), interceptors=[Pipeline([logs_service])]
    )
    logs_pb2_grpc.add_InvocationLogsServicer_to_server(Logs(), server)
    address = f"unix:{tmp_path}/logs.sock"
    server.add_insecure_port(address)
    server.start()
    try:
        with grpc.insecure_channel(address) as channel:
            records = logs_pb2_grpc.InvocationLogsStub(channel).FollowInvocationLogs(
                logs_pb2.FollowInvocationLogsRequest(), timeout=10
            )
            got = []
            with pytest.raises(grpc.RpcError) as caught:
                for record in records:
                    got.append(record)
    finally:
        server.stop(None)
    assert len(got) == 1  # what came before the error still came
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "run_uid: gone mid-stream"


def test_a_pipeline_without_a_component_only_answers_errors(tmp_path: Path) -> None:
    # pipeline.Pipeline: a ServedCall only "where `component` is given" — without one an
    # InvokeFunction has no call to reach, and a handler that asks gets an INTERNAL answer.
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2), interceptors=[Pipeline([FUNCTION_RUNTIME])]
    )
    pb_grpc.add_FunctionRuntimeServicer_to_server(Handlers(), server)
    address = f"unix:{tmp_path}/plain.sock"
    server.add_insecure_port(address)
    server.start()
    try:
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as caught:
            pb_grpc.FunctionRuntimeStub(channel).InvokeFunction(
                pb.InvokeFunctionRequest(input=b"{}"), timeout=10
            )
    finally:
        server.stop(None)
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert caught.value.details() == "internal error: LookupError"


def test_a_streaming_methods_unexpected_error_is_logged_under_its_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(logs_pb2_grpc.InvocationLogsServicer):
        def FollowInvocationLogs(self, request: Any, context: Any) -> Iterator[Any]:
            raise RuntimeError("broken")
            yield

    logs_service = logs_pb2.DESCRIPTOR.services_by_name["InvocationLogs"].full_name
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2), interceptors=[Pipeline([logs_service])]
    )
    logs_pb2_grpc.add_InvocationLogsServicer_to_server(Broken(), server)
    address = f"unix:{tmp_path}/broken.sock"
    server.add_insecure_port(address)
    server.start()
    try:
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as caught:
            list(logs_pb2_grpc.InvocationLogsStub(channel).FollowInvocationLogs(
                logs_pb2.FollowInvocationLogsRequest(), timeout=10
            ))  # fmt: skip
    finally:
        server.stop(None)
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert "internal error in FollowInvocationLogs" in caplog.text
