"""Fixtures: real Runtime Servers (in-process on a Unix socket or TCP loopback, or `fnkernel serve`
as a subprocess), real stacks, and the fnkernel kernelspec. Helpers are in tests/support.py."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.support import (
    Client,
    Gate,
    ServeProcess,
    serve_in_process,
    spawn_serve,
)

# What makes a test `slow` (left out of `make test-fast`, the inner loop; `make test` runs
# everything): it starts a whole stack, cluster, kernel or server process of its own. A module
# that waits seconds on purpose (pauses, deadlines, builds) marks itself.
SLOW_FIXTURES = frozenset(
    {"stack_factory", "cluster", "kernel", "fnkernel_spec", "server_process", "kube_api"}
)


def pytest_configure(config: pytest.Config) -> None:
    """A kernel's embedded runtime keeps the user's secrets and the machine's installed
    requirements in the user's state dir (docs/protocol.md, "Secrets", "Requirements"), and
    gateways and kernels leave their files in the runtime dir (README, "Security"): the
    kernels and stacks the tests start keep theirs in dirs of the session's own, not the home
    directory's (a test that means another names it)."""
    for variable, prefix in (
        ("FNKERNEL_STATE_DIR", "fnkernel-tests-state-"),
        ("FNKERNEL_RUNTIME_DIR", "fnkernel-tests-runtime-"),
    ):
        if variable not in os.environ:
            made = tempfile.mkdtemp(prefix=prefix)  # 0700, as a runtime dir must be
            os.environ[variable] = made
            config.add_cleanup(lambda made=made: shutil.rmtree(made, ignore_errors=True))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the slow tests (SLOW_FIXTURES). Under mutation testing (docs/architecture.md,
    "Mutation testing"), fastest tests first: a mutant then dies at the cheapest test that
    catches it, not after every slower one before it in file order. mutmut runs in mutants/,
    beside the durations it measured."""
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    stats = Path("mutmut-stats.json")
    if "MUTANT_UNDER_TEST" not in os.environ or not stats.is_file():
        return
    durations = json.loads(stats.read_text())["duration_by_test"]
    items.sort(key=lambda item: durations.get(item.nodeid, 0.0))


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    root = tmp_path / "workspace"
    root.mkdir()
    return root


@pytest.fixture
def python_rt(workspace: Path, tmp_path: Path) -> Iterator[Client]:
    """A python Runtime Server on a Unix socket."""
    yield from serve_in_process("python", workspace, f"unix:{tmp_path}/python.sock")


@pytest.fixture
def bash_rt(workspace: Path, tmp_path: Path) -> Iterator[Client]:
    """A bash Runtime Server on a Unix socket."""
    yield from serve_in_process("bash", workspace, f"unix:{tmp_path}/bash.sock")


@pytest.fixture(params=["unix", "tcp"])
def python_any(request: pytest.FixtureRequest, workspace: Path, tmp_path: Path) -> Iterator[Client]:
    """The python Runtime Server over a Unix socket and over TCP loopback."""
    listen = f"unix:{tmp_path}/py.sock" if request.param == "unix" else "127.0.0.1:0"
    yield from serve_in_process("python", workspace, listen)


@pytest.fixture
def server_process(workspace: Path) -> Iterator[Callable[..., ServeProcess]]:
    """`fnkernel serve` as a real subprocess (args are its flags); killed at teardown."""
    started: list[ServeProcess] = []

    def start(*args: str, listen: str = "127.0.0.1:0") -> ServeProcess:
        assert args[0] == "--runtime", "the first flags name the runtime"
        server = spawn_serve(args[1], workspace, *args[2:], listen=listen)
        started.append(server)
        return server

    yield start
    for server in started:
        if server.proc.poll() is None:
            server.proc.kill()
        server.proc.wait(10)


@pytest.fixture
def stack_factory(tmp_path: Path) -> Iterator[Callable[..., Stack]]:
    """Start `Stack`s (real child processes); all stopped at teardown."""
    started: list[Stack] = []

    def start(
        pods: dict[str, int] | None = None, *, state_dir: Path | None = None, **kw: object
    ) -> Stack:
        kw.setdefault("poll_interval", 0.2)
        stack = Stack(
            state_dir or tmp_path / "state",
            pods or {"python": 1, "bash": 1},
            gateway_listen="127.0.0.1:0",
            **kw,  # type: ignore[arg-type]
        )
        stack.start()
        started.append(stack)
        return stack

    yield start
    for stack in started:
        stack.stop()


@pytest.fixture(scope="module")
def shared_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One stack for the tests that only read or create uniquely named Runs."""
    stack = Stack(
        tmp_path_factory.mktemp("shared") / "state",
        {"python": 1, "bash": 1},
        gateway_listen="127.0.0.1:0",
        poll_interval=0.2,
    )
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def fnkernel_spec() -> Iterator[Path]:
    """The fnkernel kernelspec, installed under a private prefix that Jupyter is pointed at."""
    from tests.kernel.kernels import install_kernelspec

    data = install_kernelspec()
    yield data
    shutil.rmtree(data.parents[1], ignore_errors=True)


@pytest.fixture
def gate() -> Iterator[Callable[[], Gate]]:
    """Make Gates (tests/support.py) for handlers to wait on; all closed at teardown."""
    made: list[Gate] = []

    def make() -> Gate:
        made.append(Gate())
        return made[-1]

    yield make
    for one in made:
        one.close()
