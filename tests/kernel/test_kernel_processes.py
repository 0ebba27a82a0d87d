"""What a kernel starts and leaves running (docs/protocol.md, "Kernel"): its prewarmed processes,
its children after a shutdown or a SIGKILL, a stock ipykernel with the magics, a shared stack,
a restart. Real kernels through jupyter_client."""

from __future__ import annotations

import http.server
import os
import re
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.kernel.cells import ETL, GREET_SH, SLOW, gateway_address
from tests.kernel.kernels import Kernel, descendants
from tests.support import pid_alive, wait_until

pytestmark = pytest.mark.usefixtures("fnkernel_spec")


def command_lines(pids: set[int]) -> list[str]:
    return sorted(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ") for pid in pids)


def test_plain_cells_import_no_grpc_and_start_only_the_prewarmed_processes() -> None:
    # docs/protocol.md, "Kernel": a plain cell never pays for the runtime — no grpc in the
    # kernel; at start only the waiting processes of the embedded stack, which serve nothing
    # (docs/architecture.md, "The first registration").
    kernel = Kernel()
    try:
        assert kernel.value("1 + 1") == 2
        assert kernel.value("'grpc' in __import__('sys').modules") is False
        assert kernel.value("'tornado.web' in __import__('sys').modules") is False
        assert kernel.value("'ruamel.yaml' in __import__('sys').modules") is False
        assert kernel.value("'kubernetes' in __import__('sys').modules") is False
        assert kernel.value("'pyarrow' in __import__('sys').modules") is False  # on first use
        waiting = command_lines(descendants(kernel.pid))
        assert [line.split(" -m ", 1)[1].strip() for line in waiting] == [
            "fnkernel.runtime_server.cli.prewarm gateway",
            "fnkernel.runtime_server.cli.prewarm runtimed",
            "fnkernel.runtime_server.cli.prewarm serve",
        ]
    finally:
        kernel.shutdown()


def test_a_kernel_connected_to_a_shared_stack_ends_its_prewarmed_processes(
    stack_factory: Callable[..., Stack],
) -> None:
    # docs/protocol.md, "Kernel": the waiting processes serve only an embedded runtime; a
    # kernel that connects to another stack ends them rather than keep them idle.
    stack = stack_factory({"python": 1})
    kernel = Kernel()
    try:
        assert kernel.value("1 + 1") == 2
        wait_until(lambda: len(descendants(kernel.pid)) == 3, timeout=30)
        assert kernel.run(f"%fn_connect {stack.gateway_address}").ok
        wait_until(lambda: descendants(kernel.pid) == set(), timeout=10)
    finally:
        kernel.shutdown()


def test_a_mistyped_fn_connect_is_refused_or_corrected_without_a_restart(
    stack_factory: Callable[..., Stack],
) -> None:
    # README, "Magics": a URL no client can call is a one-line usage error at %fn_connect, not
    # a traceback at the next %%function; and a gateway this kernel could not reach, where it
    # has no function, is one it may leave for the right one.
    stack = stack_factory({"python": 1})
    kernel = Kernel()
    try:
        # %use before %fn_connect (a restarted kernel's first cell, say): the embedded runtime
        # it would start holds nothing, so it is not started, and %fn_connect stays open.
        assert "UsageError: %use: NAME is required: %use NAME" in kernel.run("%use").stderr
        early = kernel.run("%use etl")
        assert "UsageError: %use: no function 'etl': this kernel's embedded runtime starts " \
            "empty; to use a shared stack's, %fn_connect URL first" in early.stderr  # fmt: skip
        wrong = kernel.run("%fn_connect ftp://nowhere")
        assert "UsageError: %fn_connect: gateway address 'ftp://nowhere': give http" in wrong.stderr
        assert "Traceback" not in wrong.stderr
        absent = kernel.run("%fn_connect http://127.0.0.1:9")  # nothing listens there
        assert absent.ok  # kept: the stack may be started after it
        assert absent.stderr.startswith(
            "but nothing answers there now (cannot reach the gateway at http://127.0.0.1:9: "
        ), absent.stderr
        assert absent.stderr.endswith(
            "): start it before the first %%function, or %fn_connect the right URL\n"
        ), absent.stderr
        unreachable = kernel.run(ETL)
        assert unreachable.error is not None
        assert unreachable.error["ename"] == "GatewayUnreachable", unreachable.error
        # Its card ends as the cell did, in a headless log and in HTML alike (README, "Display").
        assert "state failed" in unreachable.texts()[-1], unreachable.texts()
        assert "fnk-edge-error" in unreachable.htmls()[-1]
        right = kernel.run(f"%fn_connect {stack.gateway_address}")
        assert right.ok and right.stderr == "", right.stderr
        cell = kernel.run(ETL)
        assert cell.ok, cell.error
        assert f"on gateway {stack.gateway_address}" in cell.texts()[-1]
        late = kernel.run("%fn_connect http://127.0.0.1:9")  # now it has a function there
        assert "restart the kernel to use another stack" in late.stderr
    finally:
        kernel.shutdown()
    # The same mistake in the environment (a CI job's): one line at the first function.
    kernel = Kernel(env={"FNKERNEL_RUNTIME": "ftp://bad"})
    try:
        cell = kernel.run(ETL)
        assert cell.error is not None and cell.error["ename"] == "StackMisconfigured"
        assert cell.error["traceback"] == [
            "StackMisconfigured: FNKERNEL_RUNTIME: gateway address 'ftp://bad': give "
            "http://HOST:PORT, https://HOST[:PORT] or unix:PATH"
        ]
    finally:
        kernel.shutdown()
    # A gateway that refuses the kernel's token is told at %fn_connect too.
    kernel = Kernel(env={"FNKERNEL_TOKEN": "not-the-token"})
    try:
        refused = kernel.run(f"%fn_connect {stack.gateway_address}")
        assert refused.ok and refused.stderr == (
            "but it refuses this kernel's token (missing or wrong bearer token "
            "(UNAUTHENTICATED)): %env FNKERNEL_TOKEN=... (its token) before the first %%function\n"
        ), refused.stderr
    finally:
        kernel.shutdown()


class _NotAGateway(http.server.BaseHTTPRequestHandler):
    """Another web server on the port a user gave: an HTML page for every GET, 501 else."""

    def do_GET(self) -> None:
        page = b"<!DOCTYPE html>\n<html><body><h1>Jupyter Server</h1>\n<p>hello</p></body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)

    def log_message(self, *args: Any) -> None:
        pass


def test_fn_connect_to_a_server_that_is_no_gateway_says_so_in_one_line() -> None:
    # README, "Magics": %fn_connect says so if what is at its URL will not take this kernel's
    # functions — another web server at that port (a pasted Jupyter URL) too — and a platform
    # error is one line, never the page it answered (docs/protocol.md, "Errors").
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotAGateway)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    kernel = Kernel()
    try:
        said = kernel.run(f"%fn_connect {url}")
        assert said.ok and said.stderr == (
            "but GET /v1/runs was answered by something that is not an fnkernel gateway (a "
            f"proxy, or another server at {url}): HTTP 200, not JSON: Jupyter Server hello: "
            "%fn_connect the gateway's URL (fnkernel up prints it)\n"
        ), said.stderr
        cell = kernel.run(ETL)  # registered there all the same: one line, not the page
        assert cell.error is not None
        [line] = cell.error["traceback"]
        assert "was answered by something that is not an fnkernel gateway" in line, line
        assert "<" not in line and "\n" not in line
    finally:
        kernel.shutdown()
        server.shutdown()
        server.server_close()


def test_without_prewarm_a_plain_kernel_starts_nothing() -> None:
    # README, "The kernel": FNKERNEL_PREWARM=0 starts the embedded stack only when needed.
    kernel = Kernel(env={"FNKERNEL_PREWARM": "0"})
    try:
        assert kernel.value("1 + 1") == 2
        assert descendants(kernel.pid) == set()
        assert kernel.run("%%function f\ndef handler(event):\n    return event\n").ok
        assert kernel.value("f(7)") == 7
    finally:
        kernel.shutdown()


def _children_of_a_kernel_with_functions() -> tuple[Kernel, set[int]]:
    kernel = Kernel()
    assert kernel.run(ETL).ok
    assert kernel.run(GREET_SH).ok
    assert kernel.value('etl({"rows": [1]})') == {"total": 1}
    children = descendants(kernel.pid)
    # the gateway, and a Runtime Server and a runtimed for each runtime used (plus workers)
    assert len(children) >= 5, children
    return kernel, children


def _cmdline(pid: int) -> str:
    """The command line and state of `pid`, to say what outlived the kernel."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        return f"{cmdline} [state {state}]"
    except OSError:
        return "?"


def test_kernel_shutdown_leaves_no_child_process() -> None:
    # The kernel stops its stack and exits by itself, leaving none of its processes and no
    # spool — not killed for taking too long to stop, as it was while the idle connection its
    # calls left (grpc's legacy poller closes none: docs/architecture.md, "grpc's I/O engine")
    # held runtimed's stop for grpc's own timeout.
    kernel, children = _children_of_a_kernel_with_functions()
    failed = kernel.run('etl.map([{"rows": [1]}, {"rows": None}])')  # its failed call's objects
    assert failed.error is not None and failed.error["ename"] == "HandlerFailedInCell"
    process: Any = kernel.manager.provisioner.process  # type: ignore[union-attr]
    spool = Path(kernel.value("str(get_ipython()._fnkernel_session.runtime._stack.spool)"))
    assert spool.is_dir()
    kernel.shutdown()
    assert process.wait(timeout=30) == 0
    wait_until(lambda: not any(pid_alive(pid) for pid in children), timeout=10)
    assert not spool.exists()


def test_sigkill_of_the_kernel_leaves_no_child_process_after_5s() -> None:
    # docs/protocol.md, "Kernel": the children also exit on their own if the kernel dies.
    kernel, children = _children_of_a_kernel_with_functions()
    state_dir = Path(kernel.value("str(get_ipython()._fnkernel_session.runtime._stack.state_dir)"))
    os.kill(kernel.pid, signal.SIGKILL)
    try:
        wait_until(lambda: not any(pid_alive(pid) for pid in children), timeout=5)
    except AssertionError:
        left = {pid: _cmdline(pid) for pid in children if pid_alive(pid)}
        raise AssertionError(f"still running 5 s after the kernel was killed: {left}") from None
    kernel.client.stop_channels()
    kernel.manager.cleanup_resources()
    # Nor does its state dir outlive the next kernel's embedded runtime (system/private.py).
    assert state_dir.exists()
    successor = Kernel()
    try:
        assert successor.run(ETL).ok
        assert not state_dir.exists()
    finally:
        successor.shutdown()


def test_magics_load_into_a_stock_ipykernel() -> None:
    # docs/protocol.md, "Kernel": the same magics load into any ipykernel with %load_ext fnkernel.kernel.
    kernel = Kernel("python3")
    try:
        assert kernel.value("'grpc' in __import__('sys').modules") is False
        assert kernel.run("%load_ext fnkernel.kernel").ok
        cell = kernel.run(ETL)
        assert cell.ok, cell.error
        assert kernel.value('etl({"rows": [2, 2]})') == {"total": 4}
    finally:
        kernel.shutdown()


def test_an_interrupt_in_a_stock_ipykernel_ends_the_call_in_one_line() -> None:
    # docs/protocol.md, "Kernel": there the interrupt is SIGINT, which lands inside the HTTP
    # read; the call is cancelled all the same, in one line, and the function stays usable.
    kernel = Kernel("python3")
    try:
        assert kernel.run("%load_ext fnkernel.kernel").ok
        assert kernel.run(SLOW).ok
        gateway = Client(gateway_address(kernel))
        msg_id = kernel.send('slow({"s": 30})')
        wait_until(lambda: (gateway.status("slow")["live"] or {}).get("inFlight") == 1, timeout=10)
        kernel.manager.interrupt_kernel()
        cell = kernel.collect(msg_id, timeout=10)
        assert cell.error is not None
        assert cell.error["traceback"] == [
            "KeyboardInterrupt: invocation of slow cancelled; the handler was killed and slow "
            "stays registered"
        ]
        assert kernel.value('slow({"s": 0})') == 0
    finally:
        kernel.shutdown()


def test_a_shared_stack_chosen_at_first_use_and_a_function_used_from_another_kernel(
    stack_factory: Callable[..., Stack],
) -> None:
    # Issue: functions shared between notebooks. The stack is chosen when the first function
    # needs it, from the environment as it is then; `%use` binds another notebook's function,
    # which that kernel never deletes; `%functions --all` marks whose each is.
    stack = stack_factory({"python": 1})
    # The user's kernel starts pointed elsewhere: %fn_connect chooses its stack all the same.
    owner, user = Kernel(), Kernel(env={"FNKERNEL_RUNTIME": "http://127.0.0.1:9"})
    try:
        assert owner.run(f"%env FNKERNEL_RUNTIME={stack.gateway_address}").ok
        cell = owner.run(ETL)
        assert cell.ok, cell.error
        assert f"on gateway {stack.gateway_address}" in cell.texts()[-1]
        gateway = Client(stack.gateway_address)
        assert [run.name for run in gateway.list_runs()] == ["etl"]  # not an embedded runtime
        gateway.create_run("other", runtime="python", handler="handler.handle",
                           files={"handler.py": "def handle(event):\n    return 'other'\n"})  # fmt: skip
        assert user.run(f"%fn_connect {stack.gateway_address}").ok
        # --all lists the stack's functions before this kernel has used any of them.
        first = user.run("%functions --all").result.splitlines()
        assert sorted(row.split()[0] for row in first[1:-1]) == ["etl", "other"], first
        used = user.run("%use etl")
        assert used.ok, used.error
        assert "used: not this kernel's" in used.result
        assert user.value('etl({"rows": [2, 3]})') == {"total": 5}
        refused = user.run("etl.unregister()")
        assert refused.error is not None and refused.error["ename"] == "NotOwned"
        mine = user.run("%functions").result.splitlines()
        assert [row.split()[0] for row in mine[1:-1]] == ["etl"] and "used here" in mine[1]
        every = {
            row.split()[0]: row for row in user.run("%functions --all").result.splitlines()[1:-1]
        }
        assert set(every) == {"etl", "other"} and "used here" in every["etl"]
        # --all names whose a used function is, besides that it is used here.
        assert re.search(r"kernel \S+ \(.+\) \(used here\)", every["etl"]), every["etl"]
        assert "this kernel" in owner.run("%functions --all").result
        assert (
            user.value("__import__('fnkernel.kernel', fromlist=['get']).get('other')(None)")
            == "other"
        )
        late = user.run("%fn_connect http://127.0.0.1:1")
        assert "UsageError: %fn_connect: this kernel already uses the gateway" in late.stderr
        assert "restart the kernel to use another stack" in late.stderr
        # Only a change of $FNKERNEL_RUNTIME after the stack was chosen refuses a %%function:
        # the user's variable named another stack from the start, and %fn_connect chose.
        mine_too = user.run(SLOW)
        assert mine_too.ok, mine_too.error
        user.shutdown()
        assert gateway.status("etl").phase == "Ready"  # the user's shutdown left it alone
        # docs/protocol.md, "Ownership": deleted from outside and made again by another, the
        # name is theirs; the owner's handle reaches the Run it registered or nothing.
        gateway.delete_run("etl")
        gateway.create_run("etl", runtime="python", handler="handler.handle",
                           files={"handler.py": "def handle(event):\n    return 'theirs'\n"})  # fmt: skip
        activity = gateway.status("etl")["live"]["lastActivityUnixNano"]
        for call in ('etl({"rows": [1]})', 'etl.map([{"rows": [1]}, {"rows": [2]}])'):
            replaced = owner.run(call)
            assert replaced.error is not None and replaced.error["ename"] == "NotOwned", call
            [line] = replaced.error["traceback"]
            assert line.startswith("NotOwned: etl is no longer this kernel's: it was deleted, and "
                                   "made again since, owned by its creator")  # fmt: skip
            assert line.endswith("not called (%use etl calls theirs)")
        assert gateway.status("etl")["live"]["lastActivityUnixNano"] == activity  # never called
    finally:
        owner.shutdown()


def test_after_a_restart_an_embedded_runtimes_function_says_why_it_is_gone(tmp_path: Path) -> None:
    # Issue: after a kernel restart, calling a function of the old kernel was a bare NameError;
    # it says that an embedded runtime's functions end with their kernel, and how to keep them.
    # The record that says so outlives a restart, not the kernel's end (no notebook names this
    # kernel, as nbclient's: nothing would read it again).
    runtime_dir = tmp_path / "runtime"
    runtime_dir.mkdir(mode=0o700)
    kernel = Kernel(env={"FNKERNEL_RUNTIME_DIR": str(runtime_dir)})  # its own: it is restarted
    try:
        assert kernel.run("%%function gone\ndef handler(event):\n    return 1\n").ok
        kernel.manager.restart_kernel(now=False)
        kernel.client.wait_for_ready(timeout=60)
        cell = kernel.run("gone(None)")
        assert cell.error is not None and cell.error["ename"] == "NameError"
        shown = "\n".join(cell.error["traceback"])
        assert "gone was a function of this notebook's previous kernel" in shown
        assert "%fn_connect URL" in shown and "%use gone" in shown
        other = kernel.run("never_defined")
        assert other.error is not None and other.error["ename"] == "NameError"
        assert "previous kernel" not in "\n".join(other.error["traceback"])
        assert len(list(runtime_dir.glob("notebook-*.json"))) == 1
    finally:
        kernel.shutdown()
    wait_until(lambda: not list(runtime_dir.glob("notebook-*.json")), timeout=30)


def test_after_a_restart_a_shared_stacks_function_says_how_to_bind_it(
    stack_factory: Callable[..., Stack],
) -> None:
    # docs/protocol.md, "Kernel": on a shared stack a notebook's functions outlive its kernel;
    # after a restart, a NameError for one says it is still registered there and how to bind
    # it — for another's function, %use — and a name that is no function there says nothing.
    stack = stack_factory({"python": 1})
    Client(stack.gateway_address).create_run(
        "theirs", runtime="python", handler="handler.handle",
        files={"handler.py": "def handle(event):\n    return 1\n"},
    )  # fmt: skip
    kernel = Kernel(env={"FNKERNEL_RUNTIME": stack.gateway_address})
    try:
        assert kernel.run("%%function kept\ndef handler(event):\n    return 1\n").ok
        kernel.manager.restart_kernel(now=False)
        kernel.client.wait_for_ready(timeout=60)
        said = {}
        for name in ("kept", "theirs", "never_defined"):
            cell = kernel.run(f"{name}(None)")
            assert cell.error is not None and cell.error["ename"] == "NameError"
            said[name] = "\n".join(cell.error["traceback"])
        assert (
            f"kept is this notebook's function on the stack at {stack.gateway_address}, still "
            "registered: run its %%function cell again to bind it" in said["kept"]
        ), said["kept"]
        assert f"theirs is a function on the stack at {stack.gateway_address}: %use theirs " \
            "binds it here." in said["theirs"]  # fmt: skip
        assert "on the stack" not in said["never_defined"]
    finally:
        kernel.shutdown()
