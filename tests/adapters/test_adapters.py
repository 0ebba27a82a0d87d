"""docs/protocol.md, "Adapters": the Python and Bash adapters through real servers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import grpc
import pytest

from fnkernel.runtime_server import limits
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server.wire import ERROR_TYPE_KEY, LOGS_KEY
from tests.support import ECHO_PY, ECHO_SH, Client, pid_alive, wait_until

READY = pb.FUNCTION_REGISTRATION_STATE_READY
FAILED = pb.FUNCTION_REGISTRATION_STATE_FAILED


def failure(call) -> grpc.RpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def trailers(error: grpc.RpcError) -> dict[str, object]:
    return dict(error.trailing_metadata())  # type: ignore[attr-defined]


# Bash: the payload is one quoted argument, never evaluated (docs/protocol.md, "Adapters").

HOSTILE = [
    "$(touch {x})",
    "`touch {x}`",
    "; touch {x}",
    "a\nb\ntouch {x}\n",
    "\"'\\\"quotes' and \\\\backslashes",
    "* ? [a-z] ~ {{a,b}}",
    "${{IFS}}$HOME$((1+1))",
    "-n",
    "é ☃ \u0007 \r\n\t",
    "",
]


@pytest.mark.parametrize("template", HOSTILE)
def test_bash_payload_reaches_the_function_byte_for_byte_and_is_never_evaluated(
    bash_rt: Client, template: str
) -> None:
    wd = bash_rt.workdir({"fn.sh": "handle() { printf '%s' \"$1\"; }\n"})
    canary = wd / "X"
    payload = template.format(x=canary).encode()
    reg = bash_rt.register(working_dir=wd)
    assert bash_rt.invoke(reg.registration, payload).output == payload
    assert not canary.exists()


def test_bash_handler_source_is_loaded_once_per_worker(bash_rt: Client) -> None:
    wd = bash_rt.workdir({"fn.sh": "echo loaded >> loads.log\nhandle() { printf ok; }\n"})
    reg = bash_rt.register(working_dir=wd)
    for _ in range(3):
        assert bash_rt.invoke(reg.registration).output == b"ok"
    assert (wd / "loads.log").read_text().count("loaded") == 1


@pytest.mark.parametrize(
    "handler",
    ["../x.handle", "/abs.f", "file.fn;rm", "file.fn rm", "dir/../x.f", "x.$(id)", "noext", ".f"],
)
def test_malformed_bash_handlers_are_invalid_argument(bash_rt: Client, handler: str) -> None:
    err = failure(lambda: bash_rt.register(ECHO_SH, handler=handler))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "handler" in err.details()


@pytest.mark.parametrize(
    ("runtime", "handler_file", "source"),
    [
        ("bash", "fn.sh", "handle() { touch pwned; }\n"),
        ("python", "handler.py", "def handle(e): return e\n"),
    ],
)
def test_handler_file_symlink_leading_out_of_working_dir_is_invalid(
    runtime: str, handler_file: str, source: str, python_rt: Client, bash_rt: Client, tmp_path: Path
) -> None:
    # docs/protocol.md: both adapters operate beneath the registered working directory.
    client = python_rt if runtime == "python" else bash_rt
    outside = tmp_path / f"evil-{handler_file}"
    outside.write_text(source)
    wd = client.workdir({})
    (wd / handler_file).symlink_to(outside)
    err = failure(lambda: client.register(working_dir=wd))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside" in err.details()


def test_bash_handler_in_a_subdirectory(bash_rt: Client) -> None:
    reg = bash_rt.register(
        {"lib/tools.sh": "greet() { printf 'hi %s' \"$1\"; }\n"}, handler="lib/tools.greet"
    )
    assert bash_rt.invoke(reg.registration, b"you").output == b"hi you"


# Initialisation failures: FAILED with a bounded fatal_error, no traceback (docs/protocol.md, "Registration").


@pytest.mark.parametrize(
    ("files", "handler", "error_type", "detail"),
    [
        (
            {"handler.py": "x = 1\ndef handle(:\n    pass\n"},
            "handler.handle",
            "UserCodeSyntaxError",
            "handler.py line 2",
        ),
        (
            {"handler.py": "import no_such_dependency_xyz\n"},
            "handler.handle",
            "ImportModuleError",
            "no_such_dependency_xyz",
        ),
        ({}, "handler.handle", "ImportModuleError", "'handler'"),
        ({"handler.py": "def other(e): pass\n"}, "handler.handle", "HandlerNotFound", "handle"),
        # Called as fn(event) or fn(event, context) (docs/protocol.md, "Adapters"): a handler
        # that takes neither could never be called.
        (
            {"handler.py": "def handle(a, b, c): pass\n"},
            "handler.handle",
            "HandlerNotFound",
            "handler.handle(a, b, c) cannot be called as fn(event) or fn(event, context)",
        ),
        ({"handler.py": "def handle(): pass\n"}, "handler.handle", "HandlerNotFound", "handle()"),
        (
            {"handler.py": "raise RuntimeError('bad config ' * 200)\n"},
            "handler.handle",
            "ImportModuleError",
            "RuntimeError",
        ),
    ],
)
def test_python_init_failure_leaves_registration_failed_with_bounded_fatal_error(
    python_rt: Client, files: dict[str, str], handler: str, error_type: str, detail: str
) -> None:
    reg = python_rt.register(files, handler=handler)
    assert reg.state == FAILED
    fatal = python_rt.status(reg.registration).fatal_error
    assert fatal.startswith(error_type) and detail in fatal
    assert "Traceback" not in fatal and len(fatal.encode()) <= limits.MAX_MESSAGE_BYTES


@pytest.mark.parametrize(
    ("files", "error_type", "detail"),
    [
        ({"fn.sh": "handle() {\n  echo unterminated\n"}, "UserCodeSyntaxError", "fn.sh: line"),
        ({"fn.sh": "other() { :; }\n"}, "HandlerNotFound", "handle"),
        ({}, "HandlerNotFound", "fn.sh"),
    ],
)
def test_bash_init_failure_leaves_registration_failed_with_bounded_fatal_error(
    bash_rt: Client, files: dict[str, str], error_type: str, detail: str
) -> None:
    reg = bash_rt.register(files)
    assert reg.state == FAILED
    fatal = bash_rt.status(reg.registration).fatal_error
    assert fatal.startswith(error_type) and detail in fatal
    assert str(bash_rt.workspace) not in fatal  # paths are shown relative to the working dir


# Handler failures: UNKNOWN, "handler error: <Type>: <message>", fn-error-type; still usable.

PY_FAILING = {
    "handler.py": """
        import sys

        def handle(event):
            if event == "raise":
                raise ValueError("no such table: orders")
            if event == "exit":
                sys.exit(3)
            if event == "unencodable":
                return {1, 2}
            if event == "not arrow":  # an Arrow kind Arrow cannot hold
                import pandas
                return pandas.DataFrame([[1, 2]], columns=["a", "a"])
            if event == "crash":
                import os
                os._exit(7)
            return "fine"
    """
}


@pytest.mark.parametrize(
    ("event", "error_type", "message"),
    [
        ("raise", "ValueError", "no such table: orders"),
        ("exit", "SystemExit", "sys.exit(3)"),
        ("unencodable", "ResultNotJSONSerializable", "JSON"),
        ("not arrow", "ResultNotArrow", "cannot be written as Arrow: Duplicate column names"),
        ("crash", "WorkerCrashed", "exit status 7"),
    ],
)
def test_python_handler_failure_is_unknown_with_error_type_and_stays_usable(
    python_rt: Client, event: str, error_type: str, message: str
) -> None:
    reg = python_rt.register(PY_FAILING)
    err = failure(lambda: python_rt.invoke(reg.registration, json.dumps(event).encode()))
    assert err.code() == grpc.StatusCode.UNKNOWN
    assert err.details().startswith(f"handler error: {error_type}: ") and message in err.details()
    assert "Traceback" not in err.details()
    assert trailers(err)[ERROR_TYPE_KEY] == error_type
    wait_until(lambda: python_rt.status(reg.registration).in_flight == 0)
    assert python_rt.invoke(reg.registration, b'"ok"').output == b'"fine"'


def test_python_traceback_goes_to_the_logs_not_the_message(python_rt: Client) -> None:
    reg = python_rt.register(PY_FAILING)
    err = failure(lambda: python_rt.invoke(reg.registration, b'"raise"'))
    logs = json.loads(trailers(err)[LOGS_KEY])  # type: ignore[arg-type]
    text = "\n".join(line["text"] for line in logs)
    assert "Traceback" in text and "ValueError: no such table: orders" in text


SH_FAILING = {
    "fn.sh": """
        handle() {
            case "$1" in
                exit3) echo "cannot reach db" >&2; exit 3 ;;
                false) return 1 ;;
                kill) kill -KILL $BASHPID ;;
                *) printf fine ;;
            esac
        }
    """
}


@pytest.mark.parametrize(
    ("payload", "error_type", "message"),
    [
        (b"exit3", "NonZeroExit", "handle exited with status 3: cannot reach db"),
        (b"false", "NonZeroExit", "status 1"),
        (b"kill", "HandlerKilled", "SIGKILL"),
    ],
)
def test_bash_handler_failure_is_unknown_with_error_type_and_stays_usable(
    bash_rt: Client, payload: bytes, error_type: str, message: str
) -> None:
    reg = bash_rt.register(SH_FAILING)
    err = failure(lambda: bash_rt.invoke(reg.registration, payload))
    assert err.code() == grpc.StatusCode.UNKNOWN
    assert err.details().startswith(f"handler error: {error_type}: ") and message in err.details()
    assert trailers(err)[ERROR_TYPE_KEY] == error_type
    assert bash_rt.invoke(reg.registration, b"again").output == b"fine"


# The runner calls the function in itself (adapters/bash_runner.sh): a function that ends the shell
# ends the worker, and that exit status is the call's result (docs/protocol.md, "Adapters": the registration stays READY).


@pytest.mark.parametrize(
    ("body", "output"),
    [
        ("printf '%s' \"$1\"; exit 0", b"ping"),
        ("exec printf '%s' \"$1\"", b"ping"),
    ],
)
def test_bash_function_that_ends_the_shell_with_status_0_succeeds_and_stays_usable(
    bash_rt: Client, body: str, output: bytes
) -> None:
    reg = bash_rt.register({"fn.sh": f"handle() {{ {body}; }}\n"})
    for _ in range(3):
        assert bash_rt.invoke(reg.registration, b"ping").output == output


def test_bash_errexit_failure_is_the_call_status_and_stays_usable(bash_rt: Client) -> None:
    reg = bash_rt.register(
        {"fn.sh": 'set -euo pipefail\nhandle() { [ "$1" = ok ] || false; printf fine; }\n'}
    )
    err = failure(lambda: bash_rt.invoke(reg.registration, b"bad"))
    assert err.code() == grpc.StatusCode.UNKNOWN
    assert trailers(err)[ERROR_TYPE_KEY] == "NonZeroExit" and "status 1" in err.details()
    assert bash_rt.invoke(reg.registration, b"ok").output == b"fine"


def test_bash_shell_state_persists_between_calls_of_one_worker(bash_rt: Client) -> None:
    # Documented in the README, like a Python handler's module globals.
    reg = bash_rt.register(
        {"fn.sh": "calls=0\nhandle() { calls=$((calls + 1)); printf $calls; }\n"}
    )
    assert [bash_rt.invoke(reg.registration).output for _ in range(3)] == [b"1", b"2", b"3"]


def test_bash_function_children_do_not_hold_the_frame_pipes(bash_rt: Client) -> None:
    reg = bash_rt.register({"fn.sh": "handle() { ls /proc/self/fd | sort -n | tr '\\n' ' '; }\n"})
    # 0-2, plus the fd ls opens to read the directory: no pipe of the runner's is inherited.
    assert bash_rt.invoke(reg.registration).output.split() == [b"0", b"1", b"2", b"3"]


def test_invalid_json_input_to_python_is_invalid_argument(python_rt: Client) -> None:
    reg = python_rt.register(ECHO_PY)
    err = failure(lambda: python_rt.invoke(reg.registration, b"{not json"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "JSON" in err.details()
    assert python_rt.invoke(reg.registration, b"1").output.startswith(b'{"echo":1')


def test_nul_byte_in_bash_input_is_invalid_argument(bash_rt: Client) -> None:
    reg = bash_rt.register(ECHO_SH)
    err = failure(lambda: bash_rt.invoke(reg.registration, b'"a\x00b"'))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "NUL" in err.details()


# Outputs, logs, environment, context.


def test_python_context_outputs_and_logs(python_rt: Client) -> None:
    reg = python_rt.register(
        {
            "handler.py": """
                import os

                def handle(event, context):
                    print("rows:", len(event))
                    context.logger.warning("slow query")
                    context.set_output("rows", str(len(event)))
                    context.set_output("ratio", 0.5)
                    return {
                        "run_uid": context.run_uid,
                        "remaining_ok": 0 < context.remaining_millis() <= 2000,
                        "deadline_ok": context.deadline_unix_nano > 0,
                        "env": os.environ["TABLE"],
                    }
            """
        },
        run_uid="ctx-run",
        env={"TABLE": "orders"},
    )
    call = python_rt.fn.InvokeFunction.with_call(
        pb.InvokeFunctionRequest(
            registration=reg.registration, input=b"[1,2,3]", timeout_millis=2000
        ),
        timeout=10,
    )
    response, rpc = call
    assert json.loads(response.output) == {
        "run_uid": "ctx-run",
        "remaining_ok": True,
        "deadline_ok": True,
        "env": "orders",
    }
    assert dict(response.outputs) == {"rows": "3", "ratio": "0.5"}
    logs = json.loads(dict(rpc.trailing_metadata())[LOGS_KEY])
    assert {"stream": "stdout", "text": "rows: 3"} in logs
    assert {"stream": "stderr", "text": "WARNING handler: slow query"} in logs


def test_bash_outputs_logs_and_invocation_id(bash_rt: Client) -> None:
    reg = bash_rt.register(
        {
            "fn.sh": """
                handle() {
                    echo "working on $FUNCTION_INVOCATION_ID" >&2
                    echo "rows=3" >> "$FUNCTION_OUTPUTS"
                    echo "table=$TABLE" >> "$FUNCTION_OUTPUTS"
                    printf '{"ok": true}'
                }
            """
        },
        env={"TABLE": "orders"},
    )
    response, rpc = bash_rt.fn.InvokeFunction.with_call(
        pb.InvokeFunctionRequest(
            registration=reg.registration, invocation_id="inv-42", input=b"{}"
        ),
        timeout=10,
    )
    assert response.output == b'{"ok": true}' and response.content_type == "application/json"
    assert dict(response.outputs) == {"rows": "3", "table": "orders"}
    assert {"stream": "stderr", "text": "working on inv-42"} in json.loads(
        dict(rpc.trailing_metadata())[LOGS_KEY]
    )


def test_outputs_over_the_bounds_are_a_handler_error(python_rt: Client) -> None:
    reg = python_rt.register(
        {"handler.py": "def handle(e, c):\n    c.set_output('big', 'x' * 2000)\n    return 1\n"}
    )
    err = failure(lambda: python_rt.invoke(reg.registration))
    assert (
        err.code() == grpc.StatusCode.UNKNOWN and trailers(err)[ERROR_TYPE_KEY] == "InvalidOutputs"
    )


@pytest.mark.parametrize("runtime", ["python", "bash"])
def test_output_over_6_mib_is_output_too_large(
    runtime: str, python_rt: Client, bash_rt: Client
) -> None:
    client = python_rt if runtime == "python" else bash_rt
    files = (
        {"handler.py": "def handle(e):\n    return 'x' * (6 * 1024 * 1024 + 1)\n"}
        if runtime == "python"
        else {"fn.sh": "handle() { head -c 6291457 /dev/zero | tr '\\0' x; }\n"}
    )
    reg = client.register(files)
    err = failure(lambda: client.invoke(reg.registration))
    assert (
        err.code() == grpc.StatusCode.UNKNOWN and trailers(err)[ERROR_TYPE_KEY] == "OutputTooLarge"
    )
    assert client.status(reg.registration).state == READY


@pytest.mark.parametrize("runtime", ["python", "bash"])
def test_a_6_mib_payload_round_trips(runtime: str, python_rt: Client, bash_rt: Client) -> None:
    client = python_rt if runtime == "python" else bash_rt
    files = {"handler.py": "def handle(e):\n    return e\n"} if runtime == "python" else ECHO_SH
    reg = client.register(files)
    payload = json.dumps("é" * ((limits.MAX_PAYLOAD_BYTES - 2) // 2), ensure_ascii=False).encode()
    assert len(payload) == limits.MAX_PAYLOAD_BYTES
    response = client.invoke(reg.registration, payload, timeout=60)
    if runtime == "python":
        assert json.loads(response.output) == json.loads(payload)
    else:
        assert response.output == payload


def test_bash_cancel_kills_the_job_and_its_children(bash_rt: Client) -> None:
    wd = bash_rt.workdir(
        {"fn.sh": "handle() { sleep 60 & echo $! > child.pid; echo $BASHPID > job.pid; wait; }\n"}
    )
    reg = bash_rt.register(working_dir=wd)
    future = bash_rt.invoke_future(reg.registration, b"{}")
    job = int(
        wait_until(lambda: (wd / "job.pid").exists() and (wd / "job.pid").read_text().strip())
    )
    child = int(
        wait_until(lambda: (wd / "child.pid").exists() and (wd / "child.pid").read_text().strip())
    )
    bash_rt.unregister(reg.registration, cancel=True)
    with pytest.raises(grpc.RpcError):
        future.result(timeout=5)
    wait_until(lambda: not pid_alive(job) and not pid_alive(child), timeout=2)


def test_workers_do_not_inherit_bash_env(
    bash_rt: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/architecture.md, "Measured facts the design rests on": clear BASH_ENV, or bash would run it before our runner.
    evil = tmp_path / "bashenv.sh"
    evil.write_text("touch " + str(tmp_path / "ran") + "\n")
    monkeypatch.setenv("BASH_ENV", str(evil))
    reg = bash_rt.register(ECHO_SH)
    assert bash_rt.invoke(reg.registration, b"x").output == b"x"
    assert not (tmp_path / "ran").exists()


def test_unregister_stops_the_worker_process(python_rt: Client) -> None:
    wd = python_rt.workdir({"handler.py": "import os\ndef handle(e):\n    return os.getpid()\n"})
    reg = python_rt.register(working_dir=wd)
    pid = int(python_rt.invoke(reg.registration).output)
    assert pid != os.getpid() and pid_alive(pid)
    python_rt.unregister(reg.registration)
    wait_until(lambda: not pid_alive(pid), timeout=2)


def test_a_runs_own_env_cannot_name_bash_env_either(bash_rt: Client, tmp_path: Path) -> None:
    # README, "Configuration and limits": BASH_ENV and ENV are removed from the environment bash starts
    # with, the registration's own env included.
    evil = tmp_path / "bashenv.sh"
    evil.write_text("touch " + str(tmp_path / "ran") + "\n")
    reg = bash_rt.register(ECHO_SH, env={"BASH_ENV": str(evil)})
    assert bash_rt.invoke(reg.registration, b"x").output == b"x"
    assert not (tmp_path / "ran").exists()


def test_a_worker_crash_is_seen_at_once_although_its_child_holds_the_pipe(
    python_rt: Client,
) -> None:
    # The worker's own exit ends the call (WorkerCrashed), not end-of-file on the response
    # pipe, which a child the handler left running keeps open: before, the call waited for its
    # whole timeout and answered DEADLINE_EXCEEDED.
    wd = python_rt.workdir(
        {
            "handler.py": (
                "import os, time\n"
                "def handle(event):\n"
                "    if event == 'fork':\n"
                "        if os.fork() == 0:\n"
                "            time.sleep(120)\n"
                "            os._exit(0)\n"
                "        return os.getpid()\n"
                "    if event == 'crash':\n"
                "        os._exit(3)\n"
                "    return 'ok'\n"
            )
        }
    )
    reg = python_rt.register(working_dir=wd)
    python_rt.invoke(reg.registration, b'"fork"')
    error = failure(
        lambda: python_rt.invoke(reg.registration, b'"crash"', timeout_millis=60_000, timeout=90)
    )
    assert error.code() == grpc.StatusCode.UNKNOWN, error.details()
    assert trailers(error)[ERROR_TYPE_KEY] == "WorkerCrashed"
    assert "exit status 3" in (error.details() or "")
    assert python_rt.invoke(reg.registration, b'"again"').output == b'"ok"'


def test_the_logs_trailer_keeps_the_last_lines_in_order_within_4_kib(python_rt: Client) -> None:
    # docs/protocol.md, "Errors": a call's log lines come back as JSON in fn-logs-bin, bounded:
    # past the 4 KiB budget, the last lines are kept, in the order they were written.
    handler = (
        "def handle(event):\n"
        "    for i in range(200):\n"
        "        print(f'line {i:03d} ' + 'x' * 40)\n"
        "    return 'done'\n"
    )
    reg = python_rt.register({"handler.py": handler})
    response, call = python_rt.fn.InvokeFunction.with_call(
        pb.InvokeFunctionRequest(
            registration=reg.registration, input=b"{}", content_type="application/json"
        ),
        timeout=30,
    )
    assert response.output == b'"done"'
    raw = dict(call.trailing_metadata())[LOGS_KEY]
    assert len(raw) <= 4096
    note, *texts = [line["text"] for line in json.loads(raw)]
    assert texts[-1].startswith("line 199 ")
    numbers = [int(text.split()[1]) for text in texts]
    assert numbers == list(range(200 - len(numbers), 200))  # the last ones, in order
    assert note.endswith(f"{200 - len(numbers)} earlier line(s) left out]")  # and how many not
