"""A real kernel through jupyter_client, and what a cell produced (for the kernel tests and the
kernel benchmark); a notebook executed by nbclient through the kernel, and its cells' outputs."""

from __future__ import annotations

import json
import os
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from fnkernel.kernel.demo import output_text
from fnkernel.kernel.install import install
from fnkernel.kernel.kernel import KERNEL_NAME

CELL_TIMEOUT = 60.0


def install_kernelspec() -> Path:
    """Install the fnkernel kernelspec under a private prefix and point Jupyter at it (the
    kernels started afterwards, and nbclient, find it there); the data dir."""
    prefix = Path(tempfile.mkdtemp(prefix="fnkernel-spec-"))
    install(prefix=str(prefix))
    data = prefix / "share" / "jupyter"
    paths = [str(data), *filter(None, os.environ.get("JUPYTER_PATH", "").split(os.pathsep))]
    os.environ["JUPYTER_PATH"] = os.pathsep.join(paths)
    return data


@dataclass
class Cell:
    """Everything the kernel sent on IOPub for one execute_request, and its reply."""

    reply: dict[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.reply["content"]["status"] == "ok")

    @property
    def error(self) -> dict[str, Any] | None:
        for message in self.messages:
            if message["msg_type"] == "error":
                return dict(message["content"])
        return None

    @property
    def stdout(self) -> str:
        return self._stream("stdout")

    @property
    def stderr(self) -> str:
        return self._stream("stderr")

    def _stream(self, name: str) -> str:
        return "".join(
            m["content"]["text"]
            for m in self.messages
            if m["msg_type"] == "stream" and m["content"]["name"] == name
        )

    def texts(self, *types: str) -> list[str]:
        """text/plain of each display_data / execute_result / update_display_data, in order."""
        types = types or ("display_data", "execute_result", "update_display_data")
        return [
            m["content"]["data"].get("text/plain", "")
            for m in self.messages
            if m["msg_type"] in types
        ]

    def htmls(self) -> list[str]:
        return [
            m["content"]["data"]["text/html"]
            for m in self.messages
            if m["msg_type"] in ("display_data", "execute_result", "update_display_data")
            and "text/html" in m["content"]["data"]
        ]

    @property
    def result(self) -> str:
        """text/plain of the execute_result (the cell's value)."""
        results = self.texts("execute_result")
        return results[-1] if results else ""


class Kernel:
    """One kernel process and a blocking client on it."""

    def __init__(self, kernel_name: str = "fnkernel", env: dict[str, str] | None = None) -> None:
        # Its channels on Unix sockets of a directory of its own: TCP ports are picked free and
        # bound by the kernel later, and another test's server may take one meanwhile.
        self._sockets = tempfile.TemporaryDirectory(prefix="kernel-")
        self.manager = KernelManager(
            kernel_name=kernel_name, transport="ipc", ip=f"{self._sockets.name}/channel"
        )
        kwargs: dict[str, Any] = {}
        if env is not None:
            kwargs["env"] = {**os.environ, **env}
        self.manager.start_kernel(**kwargs)
        self.client: BlockingKernelClient = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)
        self._early: dict[str, list[dict[str, Any]]] = {}  # read by wait_for_output

    @property
    def pid(self) -> int:
        provisioner: Any = self.manager.provisioner
        return int(provisioner.process.pid)

    def send(self, code: str) -> str:
        """Send an execute_request; its msg_id (collect it with `collect`)."""
        return str(self.client.execute(code, allow_stdin=False))

    def wait_for_output(self, msg_id: str, text: str, timeout: float = CELL_TIMEOUT) -> None:
        """Read the cell's output until a stream message holds `text` while the cell still
        runs (AssertionError if it ends first); ``collect`` gives these messages too."""
        early = self._early.setdefault(msg_id, [])
        while True:
            message = self.client.get_iopub_msg(timeout=timeout)
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            if message["msg_type"] == "status":
                state = message["content"]["execution_state"]
                assert state != "idle", f"the cell ended before it printed {text!r}"
                continue
            early.append(message)
            if message["msg_type"] == "stream" and text in message["content"]["text"]:
                return

    def collect(self, msg_id: str, timeout: float = CELL_TIMEOUT) -> Cell:
        cell = Cell(reply={})
        cell.messages += self._early.pop(msg_id, [])
        while True:
            message = self.client.get_iopub_msg(timeout=timeout)
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            if message["msg_type"] == "status":
                if message["content"]["execution_state"] == "idle":
                    break
                continue
            cell.messages.append(message)
        while not cell.reply:
            reply = self.client.get_shell_msg(timeout=timeout)
            if reply["parent_header"].get("msg_id") == msg_id:
                cell.reply = reply
        return cell

    def run(self, code: str, timeout: float = CELL_TIMEOUT) -> Cell:
        return self.collect(self.send(code), timeout)

    def value(self, expression: str) -> Any:
        """Evaluate `expression` in the kernel and return it (it must be JSON-serializable)."""
        cell = self.run(f"import json as _json; print(_json.dumps({expression}))")
        assert cell.ok, cell.error
        # The last line: a handler the expression calls may print before it (its own stdout).
        return json.loads(cell.stdout.splitlines()[-1])

    def request(self, kind: str, **content: Any) -> dict[str, Any]:
        """A shell request (complete, inspect, ...) and its reply's content."""
        msg_id = getattr(self.client, kind)(**content)
        while True:
            reply = self.client.get_shell_msg(timeout=CELL_TIMEOUT)
            if reply["parent_header"].get("msg_id") == msg_id:
                return dict(reply["content"])

    def shutdown(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=False)
        self._sockets.cleanup()


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children, grandchildren, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def execute(directory: Path, cells: list[str], env: dict[str, str] | None = None) -> list[Any]:
    """Run `cells` as a notebook in `directory` (the kernel's cwd, as Jupyter starts it) with
    nbclient, every cell even after an error, `env` added to this process's environment (as
    ``Kernel``'s: the session's state and runtime dirs, tests/conftest.py); each cell's outputs."""
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(textwrap.dedent(cell)) for cell in cells]
    client = NotebookClient(
        notebook,
        kernel_name=KERNEL_NAME,
        timeout=60,
        allow_errors=True,
        resources={"metadata": {"path": str(directory)}},
    )
    client.execute(**({"env": {**os.environ, **env}} if env else {}))
    return [cell.outputs for cell in notebook.cells]


def text(outputs: list[Any]) -> str:
    return "\n".join(output_text(output) for output in outputs)


def error(outputs: list[Any]) -> dict[str, Any]:
    errors = [output for output in outputs if output["output_type"] == "error"]
    assert errors, f"the cell did not fail: {text(outputs)}"
    return dict(errors[0])


def usage_error(outputs: list[Any]) -> str:
    """IPython shows a UsageError as one line on stderr, not as a traceback."""
    lines = [line for line in text(outputs).splitlines() if line.startswith("UsageError: ")]
    assert len(lines) == 1, text(outputs)
    return lines[0]


def ok(outputs: list[Any]) -> str:
    assert not [o for o in outputs if o["output_type"] == "error"], text(outputs)
    return text(outputs)
