"""The evaluator chain (docs/protocol.md, "Evaluators") with real evaluators: builtin functions in-process,
real executables for the exec evaluator, and the chain served over real gRPC."""

from __future__ import annotations

import os
import stat
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fnkernel.runtime_server._proto.evaluator.v1 import evaluator_pb2, evaluator_pb2_grpc
from fnkernel.runtime_server.errors import (
    DeadlineExceeded,
    FunctionError,
    InvalidEvaluateRequest,
    NotFoundError,
)
from fnkernel.runtime_server.krm.evaluators.base import EvalRequest, split_image
from fnkernel.runtime_server.krm.evaluators.builtin import BuiltinEvaluator, bare_name
from fnkernel.runtime_server.krm.evaluators.exec import ExecEvaluator, FunctionConfigStore
from fnkernel.runtime_server.krm.evaluators.multi import MultiEvaluator
from fnkernel.runtime_server.krm.evaluators.server import RemoteEvaluator, serve
from fnkernel.runtime_server.krm.resources.resourcelist import ResourceList, format_result
from tests.reflection_client import ReflectionClient
from tests.support import pid_alive, wait_until

INPUT = b"""apiVersion: config.kubernetes.io/v1
kind: ResourceList
items:
- apiVersion: v1
  kind: ConfigMap
  metadata:
    name: settings
    namespace: old
functionConfig:
  apiVersion: v1
  kind: ConfigMap
  data:
    namespace: new
"""
FAILING_RESULTS = """\
apiVersion: config.kubernetes.io/v1
kind: ResourceList
items: []
results:
- message: replicas must be at least 2
  severity: error
  resourceRef: {apiVersion: apps/v1, kind: Deployment, namespace: prod, name: web}
  field: {path: spec.replicas}
"""


def executable(path: Path, script: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(script))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def functions(tmp_path: Path) -> Path:
    root = tmp_path / "functions"
    executable(root / "identity", "#!/bin/sh\ncat\n")
    executable(
        root / "validator",
        f"#!/bin/sh\ncat >/dev/null\ncat <<'EOF'\n{FAILING_RESULTS}EOF\necho 'validation failed' >&2\nexit 3\n",
    )
    executable(root / "garbage", "#!/bin/sh\ncat >/dev/null\necho '{not: [yaml'\nexit 1\n")
    executable(
        root / "slow",
        '#!/bin/sh\nsleep 600 &\necho $! > "$(dirname "$0")/child.pid"\nwait\n',
    )
    (root / "notes.txt").write_text("not executable")
    return root


@pytest.fixture
def store_file(tmp_path: Path) -> Path:
    path = tmp_path / "functions.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            # image → cached binary, relative to --functions
            - image: example.com/fn/identity
              tags: [v1, v1.1]
              path: identity
            - image: example.com/fn/validator
              path: validator
            """
        )
    )
    return path


def test_images_resolve_to_bare_names_and_tags() -> None:
    # docs/protocol.md, "Evaluators": builtin functions answer to the bare name and both catalog
    # registries.
    for image in (
        "set-namespace",
        "set-namespace:v0.4.1",
        "ghcr.io/kptdev/krm-functions-catalog/set-namespace:v0.4.1",
        "gcr.io/kpt-fn/set-namespace@sha256:" + "a" * 64,
    ):
        assert bare_name(image) == "set-namespace"
    assert split_image("localhost:5000/fn/x:v2") == ("localhost:5000/fn/x", "v2")
    assert BuiltinEvaluator().lookup("docker.io/someone/set-namespace") is None


def test_builtin_evaluator_runs_a_catalog_function() -> None:
    response = BuiltinEvaluator().evaluate(
        EvalRequest(INPUT, "ghcr.io/kptdev/krm-functions-catalog/set-namespace:v0.4.1")
    )
    out = ResourceList.parse(response.resource_list)
    assert out.items[0]["metadata"]["namespace"] == "new"
    assert response.evaluator == "builtin"


def test_builtin_function_errors_are_function_errors_with_structured_results() -> None:
    bad = INPUT.replace(b"namespace: new", b"other: new")
    with pytest.raises(FunctionError) as caught:
        BuiltinEvaluator().evaluate(EvalRequest(bad, "set-namespace"))
    assert caught.value.results[0]["severity"] == "error"
    assert "`data.namespace` should not be empty" in caught.value.results[0]["message"]


def test_exec_evaluator_without_exec_path_is_not_found(functions: Path) -> None:
    # docs/protocol.md, "Evaluators": an empty `exec_path` is NotFound.
    with pytest.raises(NotFoundError):
        ExecEvaluator(functions).evaluate(EvalRequest(INPUT, "example.com/fn/identity"))


def test_function_config_store_sets_exec_path_by_image_and_tag(
    functions: Path, store_file: Path
) -> None:
    store = FunctionConfigStore.load(functions, store_file)
    assert store.exec_path("example.com/fn/identity:v1") == str(functions.resolve() / "identity")
    assert store.exec_path("example.com/fn/identity", tag="v1.1").endswith("/identity")
    assert store.exec_path("example.com/fn/identity:v9") == ""
    assert store.exec_path("example.com/fn/validator:anything").endswith("/validator")
    evaluator = ExecEvaluator(functions, store)
    response = evaluator.evaluate(EvalRequest(INPUT, "example.com/fn/identity:v1"))
    assert response.resource_list == INPUT and response.evaluator == "exec"


@pytest.mark.parametrize(
    "exec_path",
    [
        "{functions}/../outside",
        "/bin/sh",
        "{functions}/link-out",
        "identity",
        "{functions}/notes.txt",
    ],
    ids=["dotdot", "absolute-outside", "symlink-out", "relative", "not-executable"],
)
def test_exec_path_outside_the_functions_dir_is_refused(
    functions: Path, tmp_path: Path, exec_path: str
) -> None:
    # docs/protocol.md, "Evaluators": exec_path must resolve (symlinks followed) inside --functions.
    executable(tmp_path / "outside", '#!/bin/sh\ntouch "$0.ran"\ncat\n')
    (functions / "link-out").symlink_to(tmp_path / "outside")
    request = EvalRequest(INPUT, "x", exec_path=exec_path.format(functions=functions))
    with pytest.raises(InvalidEvaluateRequest):
        ExecEvaluator(functions).evaluate(request)
    assert not (tmp_path / "outside.ran").exists()


def test_exec_failure_keeps_exit_code_stderr_and_structured_results(functions: Path) -> None:
    request = EvalRequest(INPUT, "v", exec_path=str(functions / "validator"))
    with pytest.raises(FunctionError) as caught:
        ExecEvaluator(functions).evaluate(request)
    error = caught.value
    assert error.exit_code == 3
    assert error.stderr.strip() == "validation failed"
    assert error.results[0]["field"]["path"] == "spec.replicas"
    assert format_result(error.results[0]) == (
        "[error] apps/v1/Deployment/prod/web spec.replicas: replicas must be at least 2"
    )


def test_exec_deadline_kills_the_process_group(functions: Path) -> None:
    request = EvalRequest(INPUT, "slow", exec_path=str(functions / "slow"))
    with pytest.raises(DeadlineExceeded):  # at its deadline: the function sleeps 600 s
        ExecEvaluator(functions).evaluate(request, deadline=time.monotonic() + 0.5)
    child = int((functions / "child.pid").read_text())
    wait_until(lambda: not pid_alive(child), timeout=5)  # the grandchild went with the group


def test_chain_falls_through_only_on_not_found(functions: Path, store_file: Path) -> None:
    # docs/protocol.md, "Evaluators": only NotFoundError falls through.
    store = FunctionConfigStore.load(functions, store_file)
    chain = MultiEvaluator([BuiltinEvaluator(), ExecEvaluator(functions, store)])
    served = chain.evaluate(EvalRequest(INPUT, "set-namespace"))
    assert served.evaluator == "builtin"
    served = chain.evaluate(EvalRequest(INPUT, "example.com/fn/identity:v1"))
    assert served.evaluator == "exec"
    assert served.skipped == ("builtin",)  # the fallback trace
    # A builtin that fails stops the chain: the exec evaluator is never asked.
    marker = functions / "set-namespace.ran"
    executable(functions / "set-namespace", f"#!/bin/sh\ntouch {marker}\ncat\n")
    fallback = FunctionConfigStore(functions, [*store.entries])
    fallback.entries.append(type(store.entries[0])("set-namespace", (), "set-namespace"))
    chain = MultiEvaluator([BuiltinEvaluator(), ExecEvaluator(functions, fallback)])
    with pytest.raises(FunctionError):
        chain.evaluate(EvalRequest(INPUT.replace(b"namespace: new", b"x: y"), "set-namespace"))
    assert not marker.exists()


def test_all_not_found_names_every_evaluator_tried(functions: Path) -> None:
    chain = MultiEvaluator([BuiltinEvaluator(), ExecEvaluator(functions)])
    with pytest.raises(NotFoundError) as caught:
        chain.evaluate(EvalRequest(INPUT, "example.com/fn/unknown:v1"))
    assert caught.value.tried == ("builtin", "exec")
    assert "tried builtin, exec" in str(caught.value)


@pytest.fixture
def evaluator_server(functions: Path, store_file: Path) -> Iterator[str]:
    chain = MultiEvaluator(
        [
            BuiltinEvaluator(),
            ExecEvaluator(functions, FunctionConfigStore.load(functions, store_file)),
        ]
    )
    server, address = serve(chain, "127.0.0.1:0")
    yield address
    server.stop(None)


def test_evaluator_server_serves_the_chain_over_grpc(evaluator_server: str) -> None:
    # docs/protocol.md, "FunctionEvaluator": FunctionEvaluator with health and reflection on every
    # server.
    remote = RemoteEvaluator(evaluator_server)
    try:
        response = remote.evaluate(EvalRequest(INPUT, "gcr.io/kpt-fn/set-namespace:v0.4"))
        assert ResourceList.parse(response.resource_list).items[0]["metadata"]["namespace"] == "new"
        assert response.evaluator == "builtin"
        with pytest.raises(NotFoundError):
            remote.evaluate(EvalRequest(INPUT, "example.com/fn/unknown"))
        with pytest.raises(FunctionError) as caught:
            remote.evaluate(EvalRequest(INPUT, "example.com/fn/validator"))
        # the structured results survive the hop
        assert caught.value.exit_code == 3
        assert caught.value.results[0]["resourceRef"]["name"] == "web"
        assert "[error] apps/v1/Deployment/prod/web spec.replicas" in caught.value.stderr
    finally:
        remote.close()
    with grpc.insecure_channel(evaluator_server) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service="evaluator.FunctionEvaluator"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        for version in ("v1", "v1alpha"):
            services = ReflectionClient(channel, version).list_services()
            assert "evaluator.FunctionEvaluator" in services


def test_evaluator_server_refuses_a_resource_list_over_6_mib(evaluator_server: str) -> None:
    remote = RemoteEvaluator(evaluator_server)
    try:
        with pytest.raises(InvalidEvaluateRequest, match="6 MiB"):
            remote.evaluate(EvalRequest(b"#" * (6 * 1024 * 1024 + 1), "set-namespace"))
    finally:
        remote.close()


@pytest.mark.parametrize(
    ("exec_path", "field"),
    [("/bin/true\0x", "NUL byte"), ("/" + "a" * 100_000, "at most 4096")],
)
def test_a_malformed_exec_path_is_invalid_argument_with_a_bounded_message(
    evaluator_server: str, exec_path: str, field: str
) -> None:
    # Before: UNKNOWN for the NUL byte, RESOURCE_EXHAUSTED (a status message over the client's
    # header limit) for the 100 KB path.
    with grpc.insecure_channel(evaluator_server) as channel:
        stub = evaluator_pb2_grpc.FunctionEvaluatorStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.EvaluateFunction(
                evaluator_pb2.EvaluateFunctionRequest(
                    resource_list=INPUT, image="x", exec_path=exec_path
                ),
                timeout=10,
            )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    details = caught.value.details() or ""
    assert "exec_path" in details and field in details and len(details) < 4096


def test_fnkernel_evaluator_command_serves_the_chain(functions: Path, store_file: Path) -> None:
    from fnkernel.runtime_server.daemon import spawn

    child = spawn(
        [
            "evaluator",
            "--listen",
            "127.0.0.1:0",
            "--functions",
            str(functions),
            "--function-config",
            str(store_file),
        ]
    )
    try:
        assert "chain builtin → exec" in child.announced
        remote = RemoteEvaluator(child.address)
        response = remote.evaluate(EvalRequest(INPUT, "example.com/fn/identity:v1.1"))
        assert response.resource_list == INPUT and response.evaluator == "exec"
        remote.close()
    finally:
        assert child.stop(10) == 0
    assert os.path.exists(functions)
