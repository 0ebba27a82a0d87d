"""``fnkernel export``: a registered KRM function as one executable file kpt can run (docs/krm.md,
"A notebook function kpt can run"). The file is run as kpt runs an exec function (a ResourceList
on stdin, one on stdout, results and exit code as the KRM function spec says), by an interpreter
that has neither fnkernel nor ruamel.yaml (``python -I -S``), through our own exec paths, and as
an executable with its ``#!`` line."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.krm.resources.resourcelist import load
from fnkernel.runtime_server.lifecycle.stack import Stack

CLI = [sys.executable, "-m", "fnkernel.runtime_server.cli"]

STAMP = """\
import helper  # a second file of the function


def handler(resource_list):
    print("stamping")  # the function's log: stderr, never the ResourceList's stdout
    for item in resource_list["items"]:
        item["metadata"].setdefault("labels", {})["stamped"] = helper.VALUE
    return resource_list
"""
CHECK = """\
def handler(resource_list, context):
    results = resource_list.setdefault("results", [])
    for item in resource_list["items"]:
        if item["kind"] == "Deployment" and item["spec"]["replicas"] < 2:
            results.append({"message": "needs 2 replicas", "severity": "error",
                            "resourceRef": {"kind": item["kind"], "name": item["metadata"]["name"]}})
    context.logger.info("checked %d resource(s)", len(resource_list["items"]))
    return resource_list
"""
BROKEN = "def handler(resource_list):\n    raise KeyError('spec')\n"

RESOURCES = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: cart # the cart service
spec:
  replicas: 3
"""


def resource_list(replicas: int = 3) -> bytes:
    items = RESOURCES.replace("replicas: 3", f"replicas: {replicas}")
    indented = "".join(
        f"  {line}\n" if i else f"- {line}\n" for i, line in enumerate(items.splitlines())
    )
    return f"apiVersion: config.kubernetes.io/v1\nkind: ResourceList\nitems:\n{indented}".encode()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    started = Stack(tmp_path_factory.mktemp("export") / "state", {"python": 1, "bash": 1},
                    gateway_listen="127.0.0.1:0", poll_interval=0.2)  # fmt: skip
    started.start()
    client = Client(started.gateway_address)
    files = {"stamp.py": STAMP, "helper.py": "VALUE = 'by-notebook'\n"}
    client.create_run("stamp", runtime="python", handler="stamp.handler", files=files)
    client.create_run("check", runtime="python", handler="check.handler", files={"check.py": CHECK})
    client.create_run("broken", runtime="python", handler="b.handler", files={"b.py": BROKEN})
    client.create_run("shell", runtime="bash", handler="fn.handler",
                      files={"fn.sh": "handler() { cat; }\n"})  # fmt: skip
    yield started
    started.stop()


@pytest.fixture(scope="module")
def exported(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("exported")
    paths = {}
    for name in ("stamp", "check", "broken"):
        done = subprocess.run(
            [*CLI, "export", name, "-o", str(out / f"{name}.pyz"), "--gateway", stack.gateway_address],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout == f"exported {name} to {out / name}.pyz\n"
        paths[name] = out / f"{name}.pyz"
    return paths


def bare_python(path: Path, data: bytes) -> subprocess.CompletedProcess[bytes]:
    """`path` run by an interpreter that sees no site-packages: no fnkernel, no ruamel.yaml."""
    return subprocess.run([sys.executable, "-I", "-S", str(path)], input=data,
                          capture_output=True, timeout=60, env={"PATH": os.defpath})  # fmt: skip


def test_the_exported_file_is_a_krm_function_on_stdin(exported: dict[str, Path]) -> None:
    done = bare_python(exported["stamp"], resource_list())
    assert done.returncode == 0, done.stderr.decode()
    out = done.stdout.decode()
    assert load(out)["items"][0]["metadata"]["labels"] == {"stamped": "by-notebook"}
    assert "name: cart # the cart service" in out  # what it did not change keeps its comment
    assert b"stamping" in done.stderr and b"stamping" not in done.stdout


def test_the_exported_file_runs_by_its_own_shebang(exported: dict[str, Path]) -> None:
    """An executable file with `#!/usr/bin/env python3`, as kpt and kustomize run it."""
    path = exported["stamp"]
    assert path.read_bytes().startswith(b"#!/usr/bin/env python3\n")
    assert os.access(path, os.X_OK)
    env = {"PATH": f"{Path(sys.executable).parent}:{os.defpath}"}
    done = subprocess.run([str(path)], input=resource_list(), capture_output=True, env=env,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    assert b"stamped: by-notebook" in done.stdout


def test_a_failing_validator_exits_1_and_keeps_its_results(exported: dict[str, Path]) -> None:
    done = bare_python(exported["check"], resource_list(replicas=1))
    assert done.returncode == 1
    results = load(done.stdout)["results"]
    assert [dict(r, resourceRef=dict(r["resourceRef"])) for r in results] == [
        {"message": "needs 2 replicas", "severity": "error",
         "resourceRef": {"kind": "Deployment", "name": "cart"}},
    ]  # fmt: skip
    assert b"checked 1 resource(s)" in done.stderr  # the context's logger writes the log
    passed = bare_python(exported["check"], resource_list(replicas=2))
    assert passed.returncode == 0 and not load(passed.stdout).get("results")


def test_a_handler_that_raises_exits_1_with_an_error_result(exported: dict[str, Path]) -> None:
    done = bare_python(exported["broken"], resource_list())
    assert done.returncode == 1
    [result] = load(done.stdout)["results"]
    assert result["severity"] == "error"
    assert result["message"] == "b.handler failed: KeyError: 'spec'"
    assert b"Traceback" in done.stderr


def test_bad_input_is_refused_on_stderr(exported: dict[str, Path]) -> None:
    done = bare_python(exported["stamp"], b"kind: Deployment\n")
    assert done.returncode == 1 and done.stdout == b""
    assert b"the input is not a ResourceList" in done.stderr


def package(root: Path, kptfile_pipeline: str = "") -> Path:
    root.mkdir()
    (root / "Kptfile").write_text(
        f"apiVersion: kpt.dev/v1\nkind: Kptfile\nmetadata:\n  name: app\n{kptfile_pipeline}"
    )
    (root / "deploy.yaml").write_text(RESOURCES)
    return root


def test_fn_eval_exec_runs_the_exported_file_on_a_package(
    exported: dict[str, Path], tmp_path: Path
) -> None:
    root = package(tmp_path / "pkg")
    done = subprocess.run([*CLI, "fn", "eval", str(root), "--exec", str(exported["stamp"])],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = (root / "deploy.yaml").read_text()
    assert "labels:\n    stamped: by-notebook" in text and "# the cart service" in text


def test_a_kptfile_exec_step_runs_it_and_a_failing_one_writes_nothing(
    exported: dict[str, Path], tmp_path: Path
) -> None:
    steps = (
        f"pipeline:\n  mutators:\n  - exec: {exported['stamp']}\n"
        f"  validators:\n  - exec: {exported['check']}\n"
    )
    root = package(tmp_path / "pkg", steps)
    render = [*CLI, "fn", "render", str(root), "--allow-exec"]
    done = subprocess.run(render, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "stamped: by-notebook" in (root / "deploy.yaml").read_text()
    (root / "deploy.yaml").write_text(RESOURCES.replace("replicas: 3", "replicas: 1"))
    failed = subprocess.run(render, capture_output=True, text=True, timeout=60)
    assert failed.returncode == 1
    assert "needs 2 replicas" in failed.stderr
    assert "stamped" not in (root / "deploy.yaml").read_text()  # nothing written


def test_only_python_functions_and_known_names_export(stack: Stack, tmp_path: Path) -> None:
    gateway = ["--gateway", stack.gateway_address]
    shell = subprocess.run([*CLI, "export", "shell", "-o", str(tmp_path / "s"), *gateway],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert shell.returncode == 2
    assert "shell is a bash function: only Python functions can be exported" in shell.stderr
    missing = subprocess.run([*CLI, "export", "nothing", "-o", str(tmp_path / "n"), *gateway],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert missing.returncode != 0 and "nothing" in missing.stderr
    assert not (tmp_path / "s").exists() and not (tmp_path / "n").exists()
