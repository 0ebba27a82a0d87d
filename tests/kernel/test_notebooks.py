"""Every notebook in notebooks/ executes cleanly with nbclient through the fnkernel kernel
(docs/architecture.md, "Layers": "every one is executed by nbclient in the test suite")."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest

from fnkernel.kernel.demo import execute, output_text, summary
from tests.support import ROOT, wait_until

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT = 60


def _demo_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("krm-demo-*"))


@pytest.fixture(scope="module")
def demo_dirs_before() -> set[Path]:
    """The krm-demo-* directories there were before the notebooks ran."""
    return _demo_dirs()


@pytest.fixture(scope="module")
def executed(fnkernel_spec: Path, demo_dirs_before: set[Path]) -> dict[str, nbformat.NotebookNode]:
    """Each notebook, executed once for this module's tests."""
    return {path.stem: execute(path, cell_timeout=CELL_TIMEOUT) for path in NOTEBOOKS}


def test_the_krm_notebook_removes_its_temporary_directory(
    executed: dict[str, nbformat.NotebookNode], demo_dirs_before: set[Path]
) -> None:
    assert _demo_dirs() - demo_dirs_before == set()


def outputs(notebook: nbformat.NotebookNode) -> list[dict[str, object]]:
    return [output for cell in notebook.cells for output in cell.get("outputs", [])]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_without_errors(
    path: Path, executed: dict[str, nbformat.NotebookNode]
) -> None:
    notebook = executed[path.stem]
    errors = [o for o in outputs(notebook) if o["output_type"] == "error"]
    assert not errors, summary(notebook)
    # stderr is a handler's own (docs/protocol.md, "Kernel": its prints are the cell's
    # output), never a warning or a traceback of ours.
    stderr = [output_text(o) for o in outputs(notebook) if o.get("name") == "stderr"]  # type: ignore[arg-type]
    assert not [text for text in stderr if "Traceback" in text or "Warning" in text], stderr


def test_the_notebooks_are_the_ones_the_issue_names() -> None:
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "protocol_tour.ipynb"}


def test_protocol_tour_shows_every_state_machine_outcome(
    executed: dict[str, nbformat.NotebookNode],
) -> None:
    # The tour demonstrates the grpcurl calls of docs/protocol.md, "Services", and each
    # FunctionRuntime row of docs/protocol.md, "Registration" live: each outcome appears in
    # its output, produced by a real Runtime Server.
    text = summary(executed["protocol_tour"])
    for outcome in [
        "'state': 'FUNCTION_REGISTRATION_STATE_READY'",  # new run_uid
        "{'status': 'ok', 'seen': {'command': 'status'}}",  # the example's base64 input, decoded
        "same reference: True",
        "RegisterFunction → ALREADY_EXISTS",
        "RegisterFunction → FAILED_PRECONDITION: registration_attempt 1 is older",
        "InvokeFunction → FAILED_PRECONDITION: registration_id reg_",
        "UnregisterFunction → FAILED_PRECONDITION",
        "FunctionStatus → NOT_FOUND",
        "FunctionStatus → FAILED_PRECONDITION",
        '"state": "FUNCTION_REGISTRATION_STATE_FAILED", "fatalError": "UserCodeSyntaxError',
        "is FAILED, not READY",
        "InvokeFunction → RESOURCE_EXHAUSTED",
        "InvokeFunction → DEADLINE_EXCEEDED",
        "is DRAINING, not READY",
        'UnregisterFunction → OK {"registration": {"runUid": "never-registered"',
        "FunctionRuntime/RegisterFunction    OK",  # the %fn_trace table
        # docs/protocol.md, "Tracing": the waterfalls of a call and of the stale call refused
        "runtime-server server: FunctionRuntime/InvokeFunction",
        "worker server: ",
        "fence=passed",
        "fence=refused: StaleRegistration",
    ]:
        assert outcome in text, outcome
    # A lower attempt is refused while the run is registered, and again once it is unregistered.
    older = (
        "FAILED_PRECONDITION: registration_attempt 1 is older than attempt 2 already seen for run"
    )
    assert text.count(older) == 2, text.count(older)


def test_krm_notebook_shows_the_three_evaluators_a_notebook_function_and_a_failing_validator(
    executed: dict[str, nbformat.NotebookNode],
) -> None:
    # Issue 5: all three evaluators serve one pipeline, a fn:// step defined in the notebook, a
    # failing validator with its results, and a fallback trace.
    text = summary(executed["krm_pipeline"])
    for shown in [
        "'builtin → exec → pod'",
        "set-namespace:v0.4.1 · builtin · ",
        # docs/protocol.md, "Kernel": "no" where an evaluator lacks the function, the one that
        # served it once, and the step's outcome apart
        "example.com/fn/set-owner · no builtin → exec · ",
        "example.com/fn/add-tier · no builtin → no exec → pod · ",
        "fn://stamp · builtin · ",
        "name: cart # the cart service",
        "validator example.com/fn/check-replicas · no builtin → no exec → pod · ",
        "[error] apps/v1/Deployment/cart spec.replicas: cart needs at least 2 replicas, has 1",
        "ConfigMap             cart-settings",
    ]:
        assert shown in text, shown
    # A validator that ran and failed: the evaluator served it, the step FAILED.
    assert re.search(
        r"check-replicas · no builtin → no exec → pod · \d+ ms · FAILED \(1 error\)", text
    )
    # The validator's exit is said once (its step), not again as the pipeline's failure.
    assert text.count("check-replicas exited with 1") == 1, text


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "cannot read {path}: No such file or directory"),
        ("{}", "{path} is not a notebook: Notebook could not be converted"),
        ("nope", "{path} is not a notebook: Notebook does not appear to be JSON"),
    ],
    ids=["missing", "no cells", "not JSON"],
)
def test_the_demo_says_in_one_line_what_is_no_notebook(
    tmp_path: Path, content: str | None, says: str
) -> None:
    # README, "Quick start": `python -m fnkernel.kernel.demo NOTEBOOK` — a path that is no
    # notebook is a usage error, before a kernel starts, not nbformat's traceback.
    path = tmp_path / "n.ipynb"
    if content is not None:
        path.write_text(content)
    done = subprocess.run(
        [sys.executable, "-m", "fnkernel.kernel.demo", str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"python -m fnkernel.kernel.demo: error: {says.format(path=path)}" in done.stderr
    assert "Traceback" not in done.stderr and "executing" not in done.stdout


def _notebook(path: Path, *sources: str) -> Path:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    notebook.metadata["kernelspec"] = {"name": "fnkernel", "display_name": "fnkernel"}
    nbformat.write(notebook, path)
    return path


@pytest.mark.usefixtures("fnkernel_spec")  # the demo starts an fnkernel kernel
def test_the_demo_stops_a_cell_past_its_timeout_and_keeps_what_ran(tmp_path: Path) -> None:
    # README, "Quick start": `--timeout SECONDS` bounds each cell; past it, one line, exit 1,
    # and --output holds the notebook as far as it ran (a failed CI job keeps it).
    path = _notebook(tmp_path / "slow.ipynb", "print('first')", "import time\ntime.sleep(600)")
    out = tmp_path / "out.ipynb"
    done = subprocess.run(
        [sys.executable, "-m", "fnkernel.kernel.demo", str(path), "--timeout", "3",
         "--output", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "a cell ran past 3 s (--timeout) and was stopped" in done.stderr
    assert "Traceback" not in done.stderr
    # What ran is in the log, as far as it got (README: it "prints its outputs").
    assert "[1] print('first')\n    first\n[2] import time …" in done.stdout, done.stdout
    first = nbformat.read(out, as_version=4).cells[0]
    assert [output_text(o) for o in first.outputs] == ["first"]


@pytest.mark.usefixtures("fnkernel_spec")  # the demo starts an fnkernel kernel
def test_the_demo_shows_what_ran_then_the_failed_cell_in_one_line(tmp_path: Path) -> None:
    # README, "Quick start": it prints the outputs of the cells that ran, the failed one's
    # traceback among them (as a CI log shows it: no colours), then says why, once.
    path = _notebook(tmp_path / "fails.ipynb", "print('first')", "1 / 0", "print('never')")
    done = subprocess.run(
        [sys.executable, "-m", "fnkernel.kernel.demo", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stdout.startswith("executing "), done.stdout
    assert "[1] print('first')\n    first\n[2] 1 / 0\n" in done.stdout
    assert "ZeroDivisionError" in done.stdout and "never" not in done.stdout
    assert "\x1b[" not in done.stdout + done.stderr
    assert done.stderr.strip().endswith("a cell failed: ZeroDivisionError: division by zero")
    assert done.stderr.count("ZeroDivisionError") == 1, done.stderr


@pytest.mark.usefixtures("fnkernel_spec")  # the demo starts an fnkernel kernel
def test_the_demo_says_a_sigterm_ended_it(tmp_path: Path) -> None:
    # A cancelled CI job: nbclient interrupts the cell and shuts the kernel down; the run says
    # it was interrupted (130), not that a cell failed (exit 1), nor ends in nbclient's cleanup
    # raising (exit 1, its traceback). (The kernel writes to the same stderr, and ipykernel may
    # say something of its own as it is stopped mid-message: not checked here.)
    started = tmp_path / "started"
    path = _notebook(
        tmp_path / "long.ipynb", f"import time, pathlib\npathlib.Path({str(started)!r}).touch()\n"
        "time.sleep(600)"
    )  # fmt: skip
    demo = subprocess.Popen(
        [sys.executable, "-m", "fnkernel.kernel.demo", str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_until(started.exists, timeout=60)
        demo.terminate()
        _, err = demo.communicate(timeout=60)
        assert demo.returncode == 130, err
        assert "interrupted: the notebook did not finish" in err and "a cell failed" not in err
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
