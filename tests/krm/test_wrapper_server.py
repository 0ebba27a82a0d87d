"""`fnkernel wrapper-server` (docs/protocol.md, "Wrapper server") as a real process, each outcome from a real
entrypoint: exit 0, non-zero with parsable results, unparsable output, and a failed start."""

from __future__ import annotations

import stat
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fnkernel.runtime_server._proto.evaluator.v1 import evaluator_pb2 as pb
from fnkernel.runtime_server._proto.evaluator.v1 import evaluator_pb2_grpc as pb_grpc
from fnkernel.runtime_server.daemon import Child, spawn
from fnkernel.runtime_server.errors import FunctionError, InvalidEvaluateRequest
from fnkernel.runtime_server.krm.evaluators.base import EvalRequest
from fnkernel.runtime_server.krm.evaluators.server import RemoteEvaluator
from fnkernel.runtime_server.krm.resources.resourcelist import ResourceList
from fnkernel.runtime_server.wire import RESULTS_KEY

INPUT = b"""apiVersion: config.kubernetes.io/v1
kind: ResourceList
items:
- {apiVersion: v1, kind: ConfigMap, metadata: {name: c}}
"""
RESULTS = """\
apiVersion: config.kubernetes.io/v1
kind: ResourceList
items: []
results:
- message: name must end in -cfg
  severity: error
  resourceRef: {apiVersion: v1, kind: ConfigMap, namespace: dev, name: c}
  field: {path: metadata.name}
- message: consider adding labels
  severity: warning
"""


def script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def wrapper() -> Iterator[Callable[..., Child]]:
    started: list[Child] = []

    def start(*entrypoint: str, extra: tuple[str, ...] = ()) -> Child:
        child = spawn(["wrapper-server", "--port", "0", *extra, "--", *entrypoint])
        started.append(child)
        return child

    yield start
    for child in started:
        child.stop(10)


def evaluate(child: Child, data: bytes = INPUT) -> bytes:
    remote = RemoteEvaluator(child.address)
    try:
        return remote.evaluate(EvalRequest(data, "local/fn")).resource_list
    finally:
        remote.close()


def test_exit_zero_returns_the_output_and_health_is_serving(
    wrapper: Callable[..., Child], tmp_path: Path
) -> None:
    child = wrapper(str(script(tmp_path, "ok", "sed 's/name: c/name: c-cfg/'\n")))
    with grpc.insecure_channel(child.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert ResourceList.parse(evaluate(child)).items[0]["metadata"]["name"] == "c-cfg"


def test_non_zero_exit_is_internal_with_listed_and_structured_results(
    wrapper: Callable[..., Child], tmp_path: Path
) -> None:
    body = f"cat >/dev/null\ncat <<'EOF'\n{RESULTS}EOF\necho 'policy check failed' >&2\nexit 1\n"
    child = wrapper(str(script(tmp_path, "validator", body)))
    with grpc.insecure_channel(child.address) as channel:
        stub = pb_grpc.FunctionEvaluatorStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.EvaluateFunction(pb.EvaluateFunctionRequest(resource_list=INPUT, image="x"))
    err = caught.value
    assert err.code() == grpc.StatusCode.INTERNAL
    assert "[error] v1/ConfigMap/dev/c metadata.name: name must end in -cfg" in err.details()
    assert "[warning]: consider adding labels" in err.details()  # kpt's form of a result
    assert "policy check failed" in err.details()
    raw = dict(err.trailing_metadata())[RESULTS_KEY]
    assert ResourceList.parse(raw).results[0]["field"]["path"] == "metadata.name"
    # and through the client, the results stay structured
    with pytest.raises(FunctionError) as failure:
        evaluate(child)
    assert [r["severity"] for r in failure.value.results] == ["error", "warning"]


def test_unparsable_output_is_failed_to_parse(
    wrapper: Callable[..., Child], tmp_path: Path
) -> None:
    child = wrapper(str(script(tmp_path, "garbage", "cat >/dev/null\necho '{not: [yaml'\n")))
    with pytest.raises(FunctionError, match="failed to parse function output"):
        evaluate(child)


def test_an_entrypoint_that_cannot_start_is_failed_to_execute(
    wrapper: Callable[..., Child], tmp_path: Path
) -> None:
    child = wrapper(str(tmp_path / "does-not-exist"))
    with grpc.insecure_channel(child.address) as channel:
        stub = pb_grpc.FunctionEvaluatorStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.EvaluateFunction(pb.EvaluateFunctionRequest(resource_list=INPUT, image="x"))
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert caught.value.details().startswith("failed to execute")


def test_max_request_body_size_is_enforced(wrapper: Callable[..., Child], tmp_path: Path) -> None:
    child = wrapper("cat", extra=("--max-request-body-size", "100"))
    with pytest.raises(InvalidEvaluateRequest, match="over the limit of 100 bytes"):
        evaluate(child, INPUT + b"#" * 100)


def test_an_entrypoint_is_required() -> None:
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "wrapper-server", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "give the function's entrypoint after --" in done.stderr
