"""docs/krm.md, "Limits": each function of a pipeline runs within a time limit per step
(``--timeout``, default 300 s) and a memory bound for each process it runs in (``--memory``,
default 1024 MiB). A function past either is stopped, the step fails with a message naming the
bound, and nothing is written — the render, and a kernel that runs it, go on."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.krm.kpt_cases import kptfile, render, starlark_package, status

pytestmark = pytest.mark.slow  # each step runs to its bound (tests/conftest.py)

HUGE_LIST = "x = [0] * 2000000000\n"  # ~16 GB, if it were allowed
ENDLESS = "n = 0\nfor i in range(2147483647):\n  for j in range(2147483647):\n    n += 1\n"


def step_error(run) -> str:  # type: ignore[no-untyped-def]
    rendered = status(run)["renderStatus"]
    return str(rendered["mutationSteps"][0].get("errorResults", [{}])[0].get("message", "")) or str(
        rendered.get("error", "")
    )


@pytest.mark.timeout(120)
def test_a_starlark_script_past_the_memory_bound_is_stopped_naming_it(tmp_path: Path) -> None:
    run = render(tmp_path, starlark_package(HUGE_LIST))
    assert run.code == 1, run.stderr
    assert "needed more than the step's memory bound of 1024 MiB (--memory)" in run.stderr
    assert run.files["resources.yaml"] == starlark_package(HUGE_LIST)["resources.yaml"]


def test_the_memory_bound_is_a_flag(tmp_path: Path) -> None:
    text = 'x = "y" * (300 * 1024 * 1024)\n'  # 300 MiB: under the default, over 128
    assert render(tmp_path / "default", starlark_package(text)).code == 0
    run = render(tmp_path / "small", starlark_package(text), "--memory", "128")
    assert run.code == 1 and "memory bound of 128 MiB (--memory)" in run.stderr


@pytest.mark.timeout(120)
def test_a_starlark_script_that_never_ends_is_stopped_at_the_steps_time_limit(
    tmp_path: Path,
) -> None:
    run = render(tmp_path, starlark_package(ENDLESS), "--timeout", "2")
    assert run.code == 1, run.stderr
    assert "did not finish within the step's time limit of 2 s (--timeout)" in run.stderr


def test_an_exec_function_past_the_memory_bound_is_stopped_naming_it(tmp_path: Path) -> None:
    files = {
        "Kptfile": kptfile("pipeline:\n  mutators:\n  - exec: python3 -c 'bytearray(2 << 30)'\n"),
        "resources.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: c\n",
    }
    run = render(tmp_path, files, "--allow-exec", "--memory", "256")
    assert run.code == 1, run.stderr
    assert "needed more than the step's memory bound of 256 MiB (--memory)" in run.stderr


@pytest.mark.parametrize(("flag", "value"), [("--memory", "10"), ("--timeout", "0")])
def test_bounds_out_of_range_are_usage_errors(tmp_path: Path, flag: str, value: str) -> None:
    run = render(tmp_path, starlark_package("x = 1\n"), flag, value)
    assert run.code == 2 and flag in run.stderr
