"""A stack's processes as a user starts and stops them (docs/protocol.md, "Runs" and "CLI"):
`fnkernel up` and `down`, the prewarmed processes a stack takes its first components from, a
state directory whose path gRPC reads as syntax, and the client CLI's commands and exit codes.
Real processes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.client.errors import GatewayError
from fnkernel.runtime_server.daemon import Prewarmed, serve_args, spawn
from fnkernel.runtime_server.lifecycle.sqlite import STORE_FILE, SqliteRunStore
from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.lifecycle.stack_calls import ECHO, StackFactory, phase_and_attempt
from tests.support import (
    GATE_WAIT,
    Gate,
    fnkernel_up,
    pid_alive,
    read_until_ready,
    wait_until,
)


@pytest.mark.parametrize("stop_with", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_fnkernel_up_prints_addresses_and_stops_everything(
    tmp_path: Path, stop_with: signal.Signals
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "up", "--state-dir", str(tmp_path / "s"),
         "--gateway-listen", "127.0.0.1:0", "--pods", "python=1,bash=1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        lines = read_until_ready(proc)
        text = "\n".join(lines)
        pids = [int(pid) for pid in re.findall(r"\(pid (\d+)\)", text)]
        assert len(pids) == 5  # two servers, two runtimeds, one gateway
        for name in ("python-0-server", "python-0-runtimed", "bash-0-server", "bash-0-runtimed"):
            assert f"{name}: unix:" in text
        gateway = re.search(r"gateway (http://127\.0\.0\.1:\d+)", text)
        assert gateway is not None
        client = Client(gateway.group(1))
        client.create_run("echo", runtime="python", handler="handler.handle", files=ECHO)
        assert client.invoke("echo", 5).value()["echo"] == 5
        proc.send_signal(stop_with)
        code = proc.wait(30)
        if stop_with != signal.SIGKILL:
            assert code == 0
        # No orphans: every component exits (on SIGKILL, through its parent-pid watch).
        wait_until(lambda: not any(pid_alive(pid) for pid in pids), timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


CLI = [sys.executable, "-m", "fnkernel.runtime_server.cli"]


def _up(state_dir: Path, stderr: int = subprocess.DEVNULL) -> subprocess.Popen[str]:
    """`fnkernel up` of one python pod on a free loopback port, in the background."""
    return subprocess.Popen(
        [*CLI, "up", "--state-dir", str(state_dir), "--gateway-listen", "127.0.0.1:0",
         "--pods", "python=1"],
        stdout=subprocess.PIPE, stderr=stderr, text=True,
    )  # fmt: skip


def test_fnkernel_down_stops_the_stack_up_started_in_its_state_dir(tmp_path: Path) -> None:
    # README, "CLI": `fnkernel up &` then `fnkernel down` with the same state dir.

    state = ["--state-dir", str(tmp_path / "s")]
    proc = _up(tmp_path / "s")
    try:
        pids = [int(pid) for pid in re.findall(r"\(pid (\d+)\)", "\n".join(read_until_ready(proc)))]
        down = subprocess.run([*CLI, "down", *state], capture_output=True, text=True, timeout=60)
        assert down.returncode == 0, down.stderr
        assert (
            down.stdout
            == f"fnkernel down: stopped the stack of {tmp_path / 's'} (pid {proc.pid})\n"
        )
        assert proc.wait(30) == 0
        assert not any(pid_alive(pid) for pid in pids)  # down waits until every one is gone
        again = subprocess.run([*CLI, "down", *state], capture_output=True, text=True, timeout=60)
        assert (again.returncode, again.stderr) == (
            1, f"fnkernel down: no stack is up with the state dir {tmp_path / 's'}\n",
        )  # fmt: skip
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_second_up_on_the_same_state_dir_is_refused_and_the_first_keeps_it(
    tmp_path: Path,
) -> None:
    # README, "CLI": `fnkernel down` stops the `up` of its state dir. A second `up` there took
    # its sockets, token and pid file, and `down` then stopped only the second: the first ran
    # on, out of reach. It is refused, naming the first.

    state = ["--state-dir", str(tmp_path / "s")]
    first = _up(tmp_path / "s")
    try:
        read_until_ready(first)
        token = (tmp_path / "s" / "token").read_text()
        second = subprocess.run(
            [*CLI, "up", *state, "--gateway-listen", "127.0.0.1:0", "--pods", "python=1"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode == 1, second.stderr
        assert (
            f"fnkernel up: a stack is already up with the state dir {tmp_path / 's'} "
            f"(pid {first.pid})" in second.stderr
        )
        assert (tmp_path / "s" / "token").read_text() == token  # nothing of the first touched
        down = subprocess.run([*CLI, "down", *state], capture_output=True, text=True, timeout=60)
        assert down.returncode == 0 and f"(pid {first.pid})" in down.stdout, down.stderr
        assert first.wait(30) == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


def test_a_stop_while_up_starts_stops_what_has_started(tmp_path: Path) -> None:
    # README, "CLI": `fnkernel down` (SIGTERM) stops the `up` of its state dir, starting or
    # not: its pid file is there from the start, and what had started is stopped — the
    # components, the spool. (It said "no stack is up", and the stack came up after.)
    state_dir = tmp_path / "s"
    up = _up(state_dir, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: (state_dir / "up.pid").exists(), timeout=30, interval=0.01)
        os.kill(int((state_dir / "up.pid").read_text()), signal.SIGTERM)
        out, err = up.communicate(timeout=60)
        assert "fnkernel up: stopped while starting" in err, (out, err)
        assert up.returncode == 130 and "ready;" not in out
        assert not (state_dir / "up.pid").exists()
        wait_until(lambda: not _running_with(str(state_dir)), timeout=10)  # its components
        assert not list(Path("/dev/shm").glob(f"fnkernel-spool-{up.pid}-*"))
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


# Where `fnkernel up`'s start may be when its stop comes: inside code Python runs from a string
# (a dataclass's generated __init__, as a module defining one is imported), then caught as
# `fnkernel up` catches it.
_STOPPED_INSIDE_EXEC = """
import os, signal, sys
from fnkernel.runtime_server.cli import daemons
signal.signal(signal.SIGTERM, daemons._interrupted)
try:
    exec("import os, signal\\nos.kill(os.getpid(), signal.SIGTERM)\\nwhile True: pass")
except KeyboardInterrupt:  # what `fnkernel up` catches is one
    sys.exit(130)
"""


def test_a_stop_landing_in_code_run_from_a_string_still_exits_130(tmp_path: Path) -> None:
    # README, "CLI": `fnkernel up` stopped while starting exits 130, wherever in its start the
    # stop lands. Caught there, a plain KeyboardInterrupt still made the interpreter end itself
    # by SIGINT under `python -m` (exit status -2): one stop in ~10-80 during `make test`.
    (tmp_path / "stopped_inside_exec.py").write_text(_STOPPED_INSIDE_EXEC)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-m", "stopped_inside_exec"], env=env, capture_output=True, timeout=60
    )
    assert done.returncode == 130, done.stderr.decode()


def _running_with(text: str) -> list[int]:
    """The processes whose command line holds `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_fnkernel_down_lets_a_call_in_flight_end_first(
    tmp_path: Path, gate: Callable[[], Gate]
) -> None:
    # docs/protocol.md, "CLI": SIGTERM (`fnkernel down`, Ctrl-C) stops accepting and lets the
    # calls in flight finish for up to 10 s — end to end: the gateway, runtimed and the server
    # each wait for them. Before, the gateway closed their connections at once.
    state = ["--state-dir", str(tmp_path / "s")]
    with fnkernel_up(tmp_path / "s", {}) as address:
        client = Client(address)
        handler = (
            GATE_WAIT + "def handle(event):\n    wait_for_gate(event['go'])\n    return 'ended'\n"
        )
        client.create_run("last", runtime="python", handler="handler.handle",
                          files={"handler.py": handler})  # fmt: skip
        go = gate()
        answers: list[object] = []
        call = threading.Thread(
            target=lambda: answers.append(  # through the gateway, as from another machine
                client.invoke("last", {"go": str(go)}, by_reference=False).decoded()
            )
        )
        call.start()
        wait_until(lambda: client.status("last")["live"]["inFlight"] == 1, timeout=20)
        down = subprocess.Popen(
            [sys.executable, "-m", "fnkernel.runtime_server.cli", "down", *state],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

        def refusing() -> bool:
            try:
                client.list_runs()
            except GatewayError:  # 503, the gateway is stopping; or its listener is closed
                return True
            return False

        wait_until(refusing, timeout=20)
        go.open()
        call.join(30)
        assert answers == ["ended"]
        assert down.wait(60) == 0  # and `up` has ended, 0 (fnkernel_up)


@pytest.mark.slow  # the stack drains its calls for 10 s on purpose (tests/conftest.py)
def test_a_stack_stopped_with_calls_in_flight_moves_none_of_its_runs(tmp_path: Path) -> None:
    # docs/protocol.md, "Runs": a Run is retried on another pod, with a new attempt, when its
    # pod dies — not when the whole stack stops. Its pods drain their calls as it stops; the
    # control plane that judged them meanwhile took each for dead ("pod python-0 stopped (no
    # heartbeat)") and moved every Run a new attempt on (found by a team lead's `fnkernel down`).
    state = tmp_path / "s"
    with fnkernel_up(state, {}, pods="python=2") as address:
        client = Client(address)
        handler = "import time\ndef handle(event):\n    time.sleep(event)\n    return event\n"
        created = client.create_run("held", runtime="python", handler="handler.handle",
                                    files={"handler.py": handler}, replicas=2)  # fmt: skip
        placed = {r["name"]: (r["assignedPod"], r["attempt"]) for r in created["replicas"]}
        assert sorted(pod for pod, _ in placed.values()) == ["python-0", "python-1"]
        ended: list[BaseException] = []  # each call's end: cut off by the stop

        def call() -> None:
            try:
                client.invoke("held", 30)
            except GatewayError as cut:
                ended.append(cut)

        calls = [threading.Thread(target=call, daemon=True) for _ in range(2)]
        for call in calls:
            call.start()
        wait_until(
            lambda: all(r["inFlight"] == 1 for r in client.status("held")["replicas"]),
            timeout=20,
        )
    # Stopped (SIGTERM, as `fnkernel down`); every Run where it was, on its first attempt.
    for thread in calls:
        thread.join(30)
    assert len(ended) == 2
    store = SqliteRunStore(state / STORE_FILE)
    try:
        after = {name: store.get(name) for name in placed}
    finally:
        store.close()
    assert {
        name: (run.status.assigned_pod, run.status.attempt) for name, run in after.items()
    } == placed
    assert {run.status.phase for run in after.values()} == {"Ready"}, after


@pytest.mark.parametrize(
    ("pods", "says"),
    [
        ("ruby=1", "'ruby=1' is not RUNTIME=COUNT with RUNTIME one of python, bash"),
        ("python=x", "'python=x': COUNT is a number of pods, got 'x'"),  # not the runtime's fault
    ],
)
def test_up_rejects_a_bad_pods_flag(tmp_path: Path, pods: str, says: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "up", "--state-dir", str(tmp_path), "--pods", pods],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 2
    assert f"--pods: {says}" in result.stderr


# gRPC reads these in a unix: target as URI syntax (docs/architecture.md, "Measured facts the
# design rests on"); "%41" is a valid escape, so it is read as "A".
GRPC_SYNTAX_PATH = "team,a?b#c%41"


def test_a_state_dir_whose_path_grpc_reads_as_syntax_still_serves(
    stack_factory: StackFactory,
) -> None:
    # `fnkernel up --state-dir` takes any directory: the state stays there, and the sockets go
    # where gRPC can name them. A short path, so that its length alone would not move them.
    with tempfile.TemporaryDirectory(prefix=f"{GRPC_SYNTAX_PATH}-") as parent:
        state_dir = Path(parent, "state")
        stack = stack_factory({"python": 1}, state_dir=state_dir)
        client = Client(stack.gateway_address)
        client.create_run("echo", runtime="python", handler="handler.handle", files=ECHO)
        assert client.invoke("echo", 5).value()["echo"] == 5
        assert (state_dir / "runs.db").is_file()
        stack.stop()


@pytest.mark.parametrize("command", ["serve", "runtimed"])
def test_a_socket_path_grpc_cannot_name_is_refused_with_the_reason(
    tmp_path: Path, command: str
) -> None:
    # Bound as given, a "," path listens where no client can reach it: refused before binding.
    listen = f"unix:{tmp_path}/{GRPC_SYNTAX_PATH}.sock"
    args = ["--runtime", "python", "--listen", listen]
    if command == "serve":
        args += ["--workspace-root", str(tmp_path)]
    else:
        args += ["--pod", "p", "--server", "unix:/nonexistent.sock", "--state-dir", str(tmp_path)]
    result = fnkernel(command, *args)
    assert result.returncode == 2, result.stderr  # a usage error, as a bad flag's value is
    assert "gRPC cannot name a Unix socket whose path holds , ? # %" in result.stderr
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.glob("*.sock"))


@pytest.mark.parametrize(
    ("command", "flag", "listen"),
    [
        ("up", "--gateway-listen", "notaport"),
        ("gateway", "--listen", "127.0.0.1:70000"),
        ("serve", "--listen", "127.0.0.1:notport"),
        ("runtimed", "--listen", "unix:"),
        ("evaluator", "--listen", "localhost"),
    ],
)
def test_a_listen_address_that_is_none_is_a_usage_error_before_anything_starts(
    tmp_path: Path, command: str, flag: str, listen: str
) -> None:
    # README, "CLI": exit 2 for a bad flag, naming it. `up` used to make its state dir and
    # token and start its pods before the gateway failed on int('notaport') (exit 1), and
    # `serve` printed gRPC's own "Failed to add port" line.
    args = (
        [flag, listen, "--state-dir", str(tmp_path / "state")]
        if command == "up"
        else [flag, listen]
    )
    if command in ("serve", "runtimed"):
        args += ["--runtime", "python"]
    if command == "runtimed":
        args += ["--pod", "p", "--server", "unix:/nonexistent.sock"]
    result = fnkernel(command, *args)
    assert result.returncode == 2, result.stderr
    assert f"error: argument {flag}: " in result.stderr
    assert "Traceback" not in result.stderr and "add_port" not in result.stderr
    assert not (tmp_path / "state").exists()  # nothing made, nothing started


def fnkernel(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", *args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=60,
    )


def test_cli_runs_and_invoke_with_exit_codes(
    shared_stack: Stack, tmp_path: Path, gate: Callable[[], Gate]
) -> None:
    # docs/protocol.md, "CLI": exit codes 0 ok, 1 function/result failure, 2 usage error.
    gateway = ["--gateway", shared_stack.gateway_address]
    source = tmp_path / "src"
    source.mkdir()
    (source / "handler.py").write_text(
        GATE_WAIT + "def handle(event, context):\n"
        "    if event.get('fail'):\n"
        "        raise RuntimeError('asked to fail')\n"
        "    if event.get('gate'):\n"
        "        print('waiting at the gate', flush=True)\n"
        "        wait_for_gate(event['gate'])\n"
        "    context.set_output('n', str(event.get('n', 0)))\n"
        "    return {'n': event.get('n', 0)}\n"
    )
    created = fnkernel("runs", "create", "cli-fn", "--runtime", "python", "--source", str(source),
                       "--handler", "handler.handle", "--env", "MODE=sekrit-value", *gateway)  # fmt: skip
    assert created.returncode == 0, created.stderr
    assert json.loads(created.stdout)["status"]["phase"] == "Ready"
    listed = fnkernel("runs", "list", *gateway)
    assert listed.returncode == 0 and re.search(
        r"cli-fn\s+python\s+Ready\s+1\s+\S+\s+-", listed.stdout
    )
    got = fnkernel("runs", "get", "cli-fn", *gateway)
    # docs/protocol.md, "Runs": the env's keys, never its values, to any token holder.
    assert json.loads(got.stdout)["spec"]["env"] == ["MODE"] and "sekrit" not in got.stdout
    ok = fnkernel("invoke", "cli-fn", '{"n": 3}', *gateway)
    assert (ok.returncode, json.loads(ok.stdout)) == (0, {"n": 3})
    assert 'outputs: {"n": "3"}' in ok.stderr
    piped = fnkernel("invoke", "cli-fn", "-", *gateway, stdin='{"n": 4}')
    assert json.loads(piped.stdout) == {"n": 4}
    failed = fnkernel("invoke", "cli-fn", '{"fail": true}', *gateway)
    assert failed.returncode == 1
    assert "HandlerFailed" in failed.stderr and "asked to fail" in failed.stderr
    # A call past its timeout says what it printed until then, as a handler's failure does.
    shut = json.dumps({"gate": str(gate())})
    late = fnkernel("invoke", "cli-fn", shut, "--timeout-ms", "500", *gateway)
    assert late.returncode == 1 and "InvocationTimedOut" in late.stderr
    assert "  [stdout] waiting at the gate" in late.stderr
    bad = fnkernel("invoke", "cli-fn", "{not json", *gateway)
    assert bad.returncode == 2 and "not JSON" in bad.stderr
    missing = fnkernel("invoke", "no-such-fn", *gateway)
    assert missing.returncode == 1 and "FunctionNotFound" in missing.stderr
    assert fnkernel("runs", "delete", "cli-fn", *gateway).returncode == 0
    assert fnkernel("runs", "get", "cli-fn", *gateway).returncode == 1


def test_cli_flags_that_cannot_apply_are_usage_errors_and_nothing_is_left_half_written(
    shared_stack: Stack, tmp_path: Path
) -> None:
    # docs/protocol.md, "CLI": exit 2 for a usage error; --output writes the result whole or
    # not at all. A flag --map cannot use is refused, not ignored; a directory as --output is
    # refused before the call; a reader that stops reading ends the command quietly.
    gateway = ["--gateway", shared_stack.gateway_address]
    source = tmp_path / "src"
    source.mkdir()
    (source / "handler.py").write_text("def handle(event):\n    return event\n")
    created = fnkernel("runs", "create", "cli-flags", "--runtime", "python", "--source",
                       str(source), "--handler", "handler.handle", *gateway)  # fmt: skip
    assert created.returncode == 0, created.stderr
    # A Run's files are text: a file that is not is named, with where it stops being text.
    binary = tmp_path / "with-binary"
    (binary / "data").mkdir(parents=True)
    (binary / "handler.py").write_text("def handle(event):\n    return event\n")
    (binary / "data" / "blob.bin").write_bytes(b"ok\xff\xfe")
    refused = fnkernel("runs", "create", "cli-binary", "--runtime", "python", "--source",
                       str(binary), "--handler", "handler.handle", *gateway)  # fmt: skip
    assert refused.returncode == 2
    assert "data/blob.bin is not UTF-8 text (invalid start byte at byte 2)" in refused.stderr
    # A Run that cannot load: exit 1, and why on stderr, where a script's log shows it.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "handler.py").write_text("def handle(event:\n    return event\n")
    failed = fnkernel("runs", "create", "cli-broken", "--runtime", "python", "--source",
                      str(broken), "--handler", "handler.handle", *gateway)  # fmt: skip
    assert failed.returncode == 1
    assert json.loads(failed.stdout)["status"]["phase"] == "Failed"
    assert failed.stderr.startswith("fnkernel: run cli-broken failed: UserCodeSyntaxError: ")
    lines = tmp_path / "items.jsonl"  # their results past what a pipe holds (64 KiB)
    lines.write_text("".join(f'"{n:04d}{"x" * 1020}"\n' for n in range(200)))
    for extra, flag in [
        (["--output", str(tmp_path / "out")], "--output"),
        (["--content-type", "application/octet-stream"], "--content-type"),
        (['{"a": 1}'], "payload"),
        (["{}"], "payload"),  # given, though it is what one call sends without one
        (["--content-type", "application/json"], "--content-type"),
        (["--invocation-id", "mine"], "--invocation-id"),
    ]:
        refused = fnkernel("invoke", "cli-flags", *extra, "--map", str(lines), *gateway)
        assert refused.returncode == 2, refused.stderr
        assert f"{flag} is for one call" in refused.stderr
    assert not (tmp_path / "out").exists()
    # A payload may follow the flags, as any argument may (a negative number too).
    for payload in ('{"a": 1}', "-5", "-"):
        late = subprocess.run(
            [sys.executable, "-m", "fnkernel.runtime_server.cli", "invoke", "cli-flags",
             "--timeout-ms", "5000", payload, *gateway],
            input='"stdin"', capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert late.returncode == 0, late.stderr
        assert json.loads(late.stdout) == ("stdin" if payload == "-" else json.loads(payload))
    stray = fnkernel("invoke", "cli-flags", "--timeout-ms", "5", "1", "2", *gateway)
    assert stray.returncode == 2 and "unrecognized arguments: 1 2" in stray.stderr
    # Refused by the command they were given to, with its usage, not the top level's.
    assert "fnkernel invoke: error: unrecognized arguments" in stray.stderr
    assert stray.stderr.startswith("usage: fnkernel invoke ")
    alone = fnkernel("invoke", "cli-flags", "1", "--concurrency", "2", *gateway)
    assert alone.returncode == 2 and "--concurrency is for --map" in alone.stderr
    # No calls in flight is no map: refused, not taken as "the function's replicas".
    none = fnkernel("invoke", "cli-flags", "--map", str(lines), "--concurrency", "0", *gateway)
    assert none.returncode == 2 and "--concurrency: must be at least 1" in none.stderr
    # "--output -" is stdout, as a payload's "-" is stdin: no file named "-".
    dash = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "invoke", "cli-flags", "7",
         "--output", "-", *gateway],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert (dash.returncode, dash.stdout) == (0, "7\n"), dash.stderr
    assert not (tmp_path / "-").exists()
    into_dir = fnkernel("invoke", "cli-flags", "1", "--output", str(tmp_path), *gateway)
    assert into_dir.returncode == 2 and "a directory" in into_dir.stderr
    assert not Path(f"{tmp_path}.part").exists()
    command = [sys.executable, "-m", "fnkernel.runtime_server.cli", "invoke", "cli-flags",
               "--map", str(lines), *gateway]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as mapped:
        assert mapped.stdout is not None and mapped.stderr is not None
        assert mapped.stdout.readline().startswith(b'"0000x')
        mapped.stdout.close()  # as `| head -1` does
        errors = mapped.stderr.read().decode()
        assert mapped.wait(timeout=60) == 141, errors
    assert "Broken pipe" not in errors and "Traceback" not in errors
    # One call's result too: 8 MiB of octets, of which the reader takes the first bytes.
    command = [sys.executable, "-m", "fnkernel.runtime_server.cli", "invoke", "cli-flags", "-",
               "--content-type", "application/octet-stream", *gateway]  # fmt: skip
    with subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as single:
        assert single.stdin is not None and single.stdout is not None
        assert single.stderr is not None
        single.stdin.write(b"\xff" * (8 << 20))
        single.stdin.close()
        assert single.stdout.read(100) == b"\xff" * 100
        single.stdout.close()  # as `| head -c 100` does
        errors = single.stderr.read().decode()
        assert single.wait(timeout=60) == 141, errors
    assert "Broken pipe" not in errors and "Traceback" not in errors


def test_cli_reports_an_unreachable_gateway(tmp_path: Path) -> None:
    result = fnkernel("runs", "list", "--gateway", f"unix:{tmp_path}/nothing.sock")
    assert result.returncode == 1
    assert "cannot reach the gateway" in result.stderr


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["--gateway", "http://127.0.0.1:99999"], {}, "--gateway: gateway address 'http://127.0"),
        (["--gateway", "nowhere"], {}, "--gateway: gateway address 'nowhere': give http://"),
        ([], {"FNKERNEL_RUNTIME": "garbage"}, "$FNKERNEL_RUNTIME: gateway address 'garbage'"),
        (["--token-file", "/no/such/token"], {}, "--token-file /no/such/token: cannot be read"),
        ([], {"FNKERNEL_TOKEN": "s3cr3t\x01tok"}, "$FNKERNEL_TOKEN holds a control character"),
    ],
)
def test_cli_names_the_flag_or_variable_of_a_bad_address_or_token(
    args: list[str], env: dict[str, str], says: str
) -> None:
    # README, "CLI": another address, or a port past 65535, is a usage error naming --gateway
    # or $FNKERNEL_RUNTIME; README, "Security": a token is never quoted (it would be in a CI
    # log), its source named instead.
    result = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "runs", "list", *args],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "FNKERNEL_RUNTIME": "unix:/nonexistent.sock", **env},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"fnkernel: {says}"), result.stderr
    assert "s3cr3t" not in result.stderr and "Traceback" not in result.stderr


def test_a_stack_takes_its_first_components_from_prewarmed_processes(
    stack_factory: StackFactory,
) -> None:
    # docs/architecture.md, "The first registration": each component's first start takes the
    # waiting process of its command; it logs where a component started afresh logs, and a
    # restart after its death starts afresh.
    prewarmed = Prewarmed()
    try:
        waiting = prewarmed.pids()
        assert set(waiting) == {"serve", "runtimed", "gateway"}
        assert prewarmed.wait_ready(30)  # each has imported what it needs, and says so
        stack = stack_factory({"python": 1}, prewarmed=prewarmed)
        started = {
            "serve": stack.component("python-0-server").child,
            "runtimed": stack.component("python-0-runtimed").child,
            "gateway": stack.component("gateway").child,
        }
        assert {c: child.pid for c, child in started.items() if child} == waiting
        client = Client(stack.gateway_address)
        client.create_run("echo", runtime="python", handler="handler.handle", files=ECHO)
        assert client.invoke("echo", {"n": 1}).value()["echo"] == {"n": 1}
        log = stack.state_dir / "logs" / "python-0-runtimed.log"
        wait_until(lambda: "attempt 1 READY as reg_" in log.read_text(), timeout=5)
        os.kill(waiting["serve"], signal.SIGKILL)
        wait_until(lambda: phase_and_attempt(client, "echo") == ("Ready", 2), timeout=10)
        server = stack.component("python-0-server").child
        assert server is not None and server.pid != waiting["serve"]
    finally:
        prewarmed.close()


def test_a_prewarmed_process_that_died_is_replaced_by_a_fresh_one(tmp_path: Path) -> None:
    # daemon.spawn: a waiting process that is gone costs a fresh start, never a failed one.
    prewarmed = Prewarmed(["serve"])
    dead = prewarmed.pids()["serve"]
    os.kill(dead, signal.SIGKILL)
    wait_until(lambda: not pid_alive(dead), timeout=5)
    (tmp_path / "ws").mkdir()
    child = spawn(
        serve_args("python", f"unix:{tmp_path}/s.sock", tmp_path / "ws"), prewarmed=prewarmed
    )
    try:
        assert child.pid != dead and "listening on unix:" in child.announced
    finally:
        child.stop()


def test_closing_the_pool_or_losing_its_owner_ends_the_waiting_processes() -> None:
    # A pool not used leaves nothing behind: close() ends its processes, and so does the death
    # of the process that started them (end of their stdin).
    prewarmed = Prewarmed(["runtimed"])
    waiting = prewarmed.pids()["runtimed"]
    prewarmed.close()
    assert not pid_alive(waiting)
    owner = subprocess.Popen(
        [sys.executable, "-c", "from fnkernel.runtime_server.daemon import Prewarmed; "
         "p = Prewarmed(['gateway']); print(p.pids()['gateway'], flush=True); "
         "import signal; signal.pause()"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert owner.stdout is not None
    pid = int(owner.stdout.readline())
    owner.kill()
    owner.wait()
    wait_until(lambda: not pid_alive(pid), timeout=10)
