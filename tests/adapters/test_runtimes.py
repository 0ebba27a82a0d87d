"""docs/architecture.md, "Adding a runtime": one adapter module plus one entry in
adapters/runtimes.py, which every part that names a runtime reads."""

from __future__ import annotations

import inspect

import pytest

from fnkernel.adapters import runtimes
from fnkernel.adapters.base import Adapter
from fnkernel.adapters.runtimes import RUNTIMES, BuiltinRuntime
from fnkernel.kernel.cellspec import Spec
from fnkernel.kernel.magics import FUNCTION_PARSER
from fnkernel.kernel.output import split_traceback
from fnkernel.runtime_server.cli import build_parser, prewarm
from fnkernel.runtime_server.lifecycle.stack import parse_pods

ECHO = BuiltinRuntime(
    "echo", extension="ech", adapter_path="fnkernel.adapters.python:PythonAdapter"
)


@pytest.mark.parametrize("name", sorted(RUNTIMES))
def test_each_entry_names_an_adapter_that_serves_it(name: str) -> None:
    cls = RUNTIMES[name].adapter()
    assert cls.runtime == name
    for method in ("check_handler", "start", "invoke", "cancel", "close"):
        assert callable(getattr(cls, method)), method
    protocol = inspect.signature(Adapter.__init__).parameters
    assert list(inspect.signature(cls.__init__).parameters) == list(protocol)


def test_an_unknown_runtime_is_refused_naming_the_choices() -> None:
    with pytest.raises(runtimes.UnknownRuntime, match=r"python, bash, got 'ruby'"):
        runtimes.runtime("ruby")


@pytest.fixture
def echo_runtime(monkeypatch: pytest.MonkeyPatch) -> BuiltinRuntime:
    monkeypatch.setitem(RUNTIMES, ECHO.name, ECHO)
    return ECHO


def test_a_new_entry_reaches_every_command_line(echo_runtime: BuiltinRuntime) -> None:
    parser = build_parser()
    for argv in (
        ["runs", "create", "f", "--runtime", "echo", "--source", "x", "--handler", "f.h"],
        ["serve", "--runtime", "echo"],
        ["runtimed", "--pod", "p", "--runtime", "echo", "--server", "unix:/x"],
    ):
        assert parser.parse_args(argv).runtime == "echo"
    assert parse_pods("echo=2") == {"echo": 2}
    assert FUNCTION_PARSER.parse_args(["f", "--runtime", "echo"]).runtime == "echo"


def test_a_new_entry_names_the_cell_file_and_is_prewarmed(echo_runtime: BuiltinRuntime) -> None:
    assert Spec("etl", "echo", "etl.handler", source="").filename == "etl.ech"
    assert Spec("etl", "bash", "etl.handler", source="").filename == "etl.sh"
    assert echo_runtime.adapter_module in prewarm.modules("serve")
    assert "fnkernel.adapters.bash" in prewarm.modules("serve")


def test_without_frames_a_runtime_logs_no_traceback_to_split() -> None:
    start = RUNTIMES["python"].traceback
    assert start is not None
    logs = [{"stream": "stdout", "text": "hi"}, {"stream": "stderr", "text": start.start}]
    assert split_traceback(logs, "python") == (logs[:1], [start.start])
    assert split_traceback(logs, "bash") == (logs, [])
