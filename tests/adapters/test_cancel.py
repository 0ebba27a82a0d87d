"""docs/protocol.md, "Adapters": a cancel kills the worker's process group and a fresh worker is
started, so the registration stays READY — also when the cancel comes as the call ends."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fnkernel.adapters.base import FunctionSpec
from fnkernel.adapters.python import PythonAdapter
from tests.support import pid_alive, wait_until

pytestmark = pytest.mark.timeout(60)
HANDLER = "import os\n\ndef handle(event):\n    return {'n': event['n'], 'pid': os.getpid()}\n"


@pytest.fixture
def adapter(tmp_path: Path) -> Iterator[PythonAdapter]:
    (tmp_path / "handler.py").write_text(HANDLER)
    adapter = PythonAdapter(
        FunctionSpec("run-cancel", tmp_path, "handler.handle"), max_output_bytes=1 << 20
    )
    adapter.start()
    yield adapter
    adapter.close()


def _invoke(adapter: PythonAdapter, n: int) -> dict[str, Any]:
    invocation = f"inv-{n}"
    result = adapter.invoke(invocation, json.dumps({"n": n}).encode(), time.monotonic() + 10)
    output: dict[str, Any] = json.loads(result.output)
    return output


def test_a_cancel_that_comes_as_the_call_ends_leaves_a_fresh_worker_for_the_next(
    adapter: PythonAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A map's first failure cancels the other lanes' calls; one of them may have just been
    # answered. Its worker is killed all the same, and the next call must not be given it: seen
    # as the next map's item failing with WorkerCrashed (killed by SIGKILL). The cancel is made
    # here at that moment: the call's answer read, the call not yet over.
    first = _invoke(adapter, 0)
    exchange = adapter._exchange

    def answered_then_cancelled(call: Any, *args: Any) -> Any:
        answer = exchange(call, *args)
        assert adapter.cancel(call.invocation_id)  # the call in flight, still: its worker killed
        return answer

    monkeypatch.setattr(adapter, "_exchange", answered_then_cancelled)
    assert _invoke(adapter, 1)["n"] == 1  # it keeps its answer
    monkeypatch.undo()
    wait_until(lambda: not pid_alive(first["pid"]))
    second = _invoke(adapter, 2)
    assert second["n"] == 2 and second["pid"] != first["pid"]
