"""The long-lived Python worker: imports one handler once, then serves framed invocations.

Run by PythonAdapter as ``python -P _python_worker.py RUN_UID MODULE FUNCTION REQ_FD RESP_FD``
with the registered working directory as cwd, held to the registration's memory by the process
that starts it (adapters/children.py: spawn_limited). It imports nothing from fnkernel,
and nothing but the standard library, orjson and msgspec (dependencies of fnkernel's, for
encoding results and reading a large JSON input, with adapters/_payloads.py, _jsonvalues.py and
_dataframes.py loaded by their paths), all before the working directory is put on sys.path:
user modules named like ours or theirs cannot shadow them (``-P``: the script's own directory is
not put on sys.path either). pyarrow, and pandas, polars or numpy, are imported on the first
payload or result of theirs (docs/protocol.md, "Content types").

Frames (see adapters/worker.py for the handshake, the nonce and the log files):
  request:  ``<id_len> <input_len> <remaining_ms> <traceparent> <type> <in> <out> <from> <if>
            <nonce>\\n`` + invocation id + input bytes, where traceparent is a traced call's W3C
            context, ``-`` for none; type the input's content type (``json``, ``arrow``,
            ``octet``: _payloads.CODES); in the name of a spooled input in $FNKERNEL_SPOOL (then
            the input bytes are none), out the name a result of at least ``from`` bytes is
            written to instead of being answered inline, each ``-`` for none (docs/protocol.md,
            "Large payloads"); if ``ok`` for a frame queued behind another call (a batch's next
            item), to be run only if that call answered ``ok``, ``-`` for always
  response: ``<ok|error|invalid|skipped> <meta_len> <output_len> <type> <inline|spooled>
            <stdout> <stderr> <nonce>\\n`` + meta JSON + output bytes (none when spooled),
            where meta is the outputs object for ``ok`` (0 bytes when there are none) and
            ``{"errorType", "errorMessage"}`` for ``error`` and ``invalid``, type the output's
            content type, stdout and stderr the sizes of the two log files as the call ends
            (-1 where unknown: where the next call's lines begin), and the nonce is the
            request's; ``skipped`` answers a frame whose ``if`` did not hold, which never ran

The two descriptor numbers are taken off ``sys.argv`` before the handler is imported: a handler
has no easy way to its answers' pipe, and an answer it forged anyway lacks the call's nonce.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import inspect
import json
import logging
import os
import sys
import time
import traceback

MAX_MESSAGE = 1024


def _load_payloads():
    """adapters/_payloads.py, by its path beside this file: the one codec of payloads and
    results, loaded before the handler's directory is on sys.path (so nothing there can stand
    in for it), and without importing fnkernel."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_payloads.py")
    spec = importlib.util.spec_from_file_location("_fnkernel_payloads", path)
    assert spec is not None and spec.loader is not None  # a .py file's
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_payloads = _load_payloads()


class Context:
    """What a handler that takes two arguments gets as its second (docs/protocol.md, "Adapters")."""

    def __init__(
        self,
        invocation_id: str,
        run_uid: str,
        remaining_ms: int,
        traceparent: str,
        logger: logging.Logger,
    ):
        self.invocation_id = invocation_id
        self.run_uid = run_uid
        # A traced call's W3C context: the worker's span, for the handler's own (docs/protocol.md,
        # "Tracing"); "" when the call is not traced.
        self.traceparent = traceparent
        self.deadline_unix_nano = time.time_ns() + remaining_ms * 1_000_000
        self.logger = logger
        self.outputs: dict[str, str] = {}

    def remaining_millis(self) -> int:
        return max(0, (self.deadline_unix_nano - time.time_ns()) // 1_000_000)

    def set_output(self, key: str, value: object) -> None:
        """Record one named output; bounds are checked by the Runtime Server (docs/protocol.md, "Limits")."""
        self.outputs[str(key)] = value if isinstance(value, str) else json.dumps(value)

    def __repr__(self) -> str:
        return f"Context(invocation_id={self.invocation_id!r}, run_uid={self.run_uid!r})"


def _bounded(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


def _relative(path: str | None) -> str:
    if not path:
        return "<unknown>"
    cwd = os.getcwd() + os.sep
    return path[len(cwd) :] if path.startswith(cwd) else os.path.basename(path)


def load_handler(module_name: str, function_name: str):
    """Import the handler once; name each failure the way a user would (awslambdaric style)."""
    try:
        module = importlib.import_module(module_name)
    except SyntaxError as exc:
        where = f"{_relative(exc.filename)} line {exc.lineno}"
        return None, ("UserCodeSyntaxError", f"{where}: SyntaxError: {exc.msg}")
    except Exception as exc:
        missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            return None, (
                "ImportModuleError",
                f"no module named {missing!r} in the working directory",
            )
        traceback.print_exc()
        frames = traceback.extract_tb(exc.__traceback__)
        if _out_of_memory(exc):
            # Where the handler's own code was (its import of pandas, say), not importlib's:
            # the supervisor says the rest (adapters/workerprocess.py, wait_ready).
            cwd = os.getcwd() + os.sep
            ours = [f for f in frames if f.filename and f.filename.startswith(cwd)] or frames
            frame = ours[-1]
            return None, ("MemoryLimitExceeded", f"{_relative(frame.filename)} line {frame.lineno}")
        frame = frames[-1]
        where = f"{_relative(frame.filename)} line {frame.lineno}"
        return None, ("ImportModuleError", f"{where}: {type(exc).__name__}: {exc}")
    function = getattr(module, function_name, None)
    if function is None:
        return None, (
            "HandlerNotFound",
            f"module {module_name!r} has no function {function_name!r}",
        )
    if not callable(function):
        return None, ("HandlerNotFound", f"{module_name}.{function_name} is not callable")
    if (signature := _signature(function)) is not None and not any(
        _binds(signature, arguments) for arguments in ((None,), (None, None))
    ):
        # It could never be called: say so now, not at every call (docs/protocol.md, "Adapters").
        return None, (
            "HandlerNotFound",
            f"{module_name}.{function_name}{signature} cannot be called as fn(event) or "
            "fn(event, context)",
        )
    return function, None


def _signature(function) -> inspect.Signature | None:
    """`function`'s signature; None where it has none to read (some builtins)."""
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):
        return None


def _binds(signature: inspect.Signature, arguments: tuple) -> bool:
    try:
        signature.bind(*arguments)
    except TypeError:
        return False
    return True


def _out_of_memory(exc: BaseException) -> bool:
    """Whether `exc`, raised loading the handler, is its memory limit (RLIMIT_DATA) run out: a
    MemoryError, or a SystemError (a C extension's module init that failed to allocate and set
    no error) under that limit."""
    return isinstance(exc, MemoryError) or (
        isinstance(exc, SystemError) and _payloads.memory_limited()
    )


def takes_context(function) -> bool:
    """Whether `function` is called with the context too: its signature takes two arguments
    (one without a signature, some builtins, is called with the event only)."""
    signature = _signature(function)
    return signature is not None and _binds(signature, (None, None))


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(stream, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise EOFError
    return data


def _respond(
    fd: int,
    nonce: bytes,
    status: bytes,
    meta: dict | None,
    output: bytes = b"",
    code=b"json",
    *,
    size: int = -1,
    where: bytes = b"inline",
) -> None:
    """One response frame; an empty meta (the common "ok" with no outputs) is sent as 0 bytes.
    A spooled output (`where`) is `size` bytes in its file, and none follow the frame."""
    sys.stdout.flush()  # the supervisor reads the log files once it has the response
    sys.stderr.flush()
    encoded = json.dumps(meta).encode() if meta else b""
    size = len(output) if size < 0 else size
    ends = b"%d %d" % (_log_end(1), _log_end(2))
    header = b"%s %d %d %s %s %s %s\n" % (status, len(encoded), size, code, where, ends, nonce)
    _write(fd, header + encoded + output)


def _log_end(fd: int) -> int:
    """The size of the log file on `fd`, -1 if it is none (a handler may have closed it)."""
    try:
        return os.fstat(fd).st_size
    except OSError:
        return -1


def serve(function, run_uid: str, requests, resp_fd: int, server: int) -> None:
    """Answer each request frame in turn until the pipe closes; `server` is our parent's pid,
    the Runtime Server's."""
    with_context = takes_context(function)
    logger = logging.getLogger("handler")
    answered_ok = True  # the last call's answer
    while True:
        header = requests.readline()
        if not header:
            return  # the supervisor closed the pipe: it is gone, so are we
        (
            id_len,
            input_len,
            remaining_ms,
            traceparent,
            code,
            spooled_in,
            spooled_out,
            out_from,
            condition,
            nonce,
        ) = header.split()
        invocation_id = _read_exact(requests, int(id_len)).decode()
        payload = _read_exact(requests, int(input_len))
        if os.getppid() != server:
            # Our server is gone (we were handed to another parent): no one will read the
            # answer, and a frame still in the pipe (a batch's item queued behind the last) is
            # not run (docs/protocol.md, "Batches").
            return
        if condition == b"ok" and not answered_ok:
            _respond(resp_fd, nonce, b"skipped", None)  # answered_ok stays: it never ran
            continue
        traced = traceparent.decode() if traceparent != b"-" else ""
        context = Context(invocation_id, run_uid, int(remaining_ms), traced, logger)
        call = _Call(
            _payloads.MEDIA_OF.get(code, _payloads.JSON),
            payload,
            _spooled(spooled_in),
            _spooled(spooled_out),
            int(out_from),
            resp_fd,
            nonce,
        )
        try:
            if traced:  # the processes the handler starts get it too, as a Bash function's do
                with _environment(TRACEPARENT=traced):
                    _answer(function, with_context, context, call)
            else:
                _answer(function, with_context, context, call)
        except MemoryError:
            # Out of its memory (RLIMIT_DATA) anywhere in the call — the handler, decoding its
            # input, encoding its result: the supervisor names the limit and replaces us.
            call.respond(b"error", {"errorType": "MemoryError", "errorMessage": ""})
        answered_ok = call.status == b"ok"


@contextlib.contextmanager
def _environment(**values: str):
    """The environment with `values` set while the block runs, then as it was."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


_SPOOL_ENV = "FNKERNEL_SPOOL"  # adapters/base.py: SPOOL_ENV


def _spooled(name: bytes) -> str:
    """The path of a payload the frame names in the spool (docs/protocol.md, "Large
    payloads"); "" for none ("-")."""
    if name == b"-":
        return ""
    return os.path.join(os.environ[_SPOOL_ENV], os.path.basename(name.decode()))


class _Call:
    """One request frame's call: its input (`payload` inline, or the file `input_path`), where a
    result of at least `output_from` bytes goes (`output_path`, "" for inline), how to answer."""

    def __init__(self, media, payload, input_path, output_path, output_from, resp_fd, nonce):
        self.media, self.payload = media, payload
        self.input_path, self.output_path, self.output_from = input_path, output_path, output_from
        self.resp_fd, self.nonce = resp_fd, nonce
        self.status = b""  # how it was answered

    def event(self):
        if not self.input_path:
            return _payloads.decode(self.payload, self.media, "input")
        # Gone from the spool at once: an Arrow input stays mapped while the handler holds it,
        # and its memory is freed with the last view of it, not at the end of the call.
        return _payloads.decode_file(self.input_path, self.media, "input")

    def respond(self, status: bytes, meta: dict | None) -> None:
        self.status = status
        _respond(self.resp_fd, self.nonce, status, meta)

    def result(self, result, outputs: dict) -> None:
        """Encode `result` and answer it: inline, or written to the spool when it is large —
        a large Arrow kind straight to its file, never whole in memory first."""
        table = _payloads.arrow_table(result, "result")
        if table is not None and self.output_path and table.nbytes >= self.output_from:
            size = _payloads.write_table(table, self.output_path)
            code = _payloads.CODES[_payloads.ARROW]
        else:
            if table is not None:
                output, media = _payloads.table_bytes(table), _payloads.ARROW
            else:
                output, media = _payloads.encode(result, "result")
            code, size = _payloads.CODES[media], len(output)
            if not self.output_path or size < self.output_from:
                self.status = b"ok"
                _respond(self.resp_fd, self.nonce, b"ok", outputs, output, code)
                return
            with _payloads.spool_file(self.output_path, size) as out:
                out.write(output)
        self.status = b"ok"
        _respond(self.resp_fd, self.nonce, b"ok", outputs, b"", code, size=size, where=b"spooled")


def _answer(function, with_context: bool, context: Context, call: _Call) -> None:
    """One call: decode, run the handler, encode, respond (MemoryError is the caller's)."""
    try:
        event = call.event()
    except _payloads.PayloadError as exc:
        message = _bounded(str(exc))
        if "is not installed here" in message:  # the runtime lacks the kind's package
            message += "; a Run brings its packages with --requirements"
        call.respond(b"invalid", {"errorMessage": message})
        return
    try:
        result = function(event, context) if with_context else function(event)
    except SystemExit as exc:
        message = f"handler called sys.exit({exc.code!r})"
        call.respond(b"error", {"errorType": "SystemExit", "errorMessage": message})
        return
    except MemoryError:
        raise
    except Exception as exc:
        tb = exc.__traceback__
        traceback.print_exception(type(exc), exc, tb.tb_next if tb else None)
        call.respond(
            b"error", {"errorType": type(exc).__name__, "errorMessage": _bounded(str(exc))}
        )
        return
    try:
        call.result(result, context.outputs)
    except _payloads.PayloadError as exc:  # an Arrow kind, and no pyarrow here
        message = _bounded(f"the return value cannot be encoded: {exc}")
        call.respond(b"error", {"errorType": "ResultNotSerializable", "errorMessage": message})
    except _payloads.NotArrow as exc:
        message = _bounded(f"the return value cannot be encoded: {exc}")
        call.respond(b"error", {"errorType": "ResultNotArrow", "errorMessage": message})
    except (TypeError, ValueError) as exc:
        message = _bounded(f"the return value cannot be encoded as JSON: {exc}")
        call.respond(b"error", {"errorType": "ResultNotJSONSerializable", "errorMessage": message})
    except OSError as exc:  # the spool's disk (docs/protocol.md, "Large payloads")
        message = _bounded(f"the return value cannot be written to the spool: {exc}")
        call.respond(b"error", {"errorType": "OutputNotWritten", "errorMessage": message})


def keep_freed_memory() -> None:
    """glibc's malloc keeps freed memory for the next call's copies of its payload, as the
    components do (runtime_server/daemon/server.py: keep_freed_memory; docs/architecture.md,
    "A payload's bytes"): blocks up to 16 MiB from the heap, up to 32 MiB of freed memory kept."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return
    mallopt(-3, 16 << 20)  # M_MMAP_THRESHOLD
    mallopt(-1, 32 << 20)  # M_TRIM_THRESHOLD


_PACKAGES_ENV = "FNKERNEL_PACKAGES"  # adapters/python.py: PACKAGES_ENV


def _add_packages(directory: str) -> None:
    """The Run's requirements (docs/protocol.md, "Requirements"), installed in `directory`:
    ahead of site-packages, so its versions win over the pod's own, but after the standard
    library, which no package may shadow; its ``.pth`` files are read as site-packages' are."""
    if not directory:
        return
    import site

    first_site = next(
        (
            i
            for i, entry in enumerate(sys.path)
            if entry.endswith(("site-packages", "dist-packages"))
        ),
        len(sys.path),
    )
    sys.path.insert(first_site, directory)
    site.addsitedir(directory)


def _leave_with_the_server(req: int) -> None:
    """Exit once the Runtime Server is gone, which closes the request pipe's other end
    (POLLHUP), on a thread that waits for nothing else: while the handler loads nothing reads
    the pipe, and one that hangs as it is imported (a loop at module level) would outlive the
    server, as would a call that runs on after it."""
    import select
    import threading

    def watch() -> None:
        poller = select.poll()
        poller.register(req, 0)  # asks for nothing: POLLHUP, POLLERR and POLLNVAL come anyway
        while True:
            if poller.poll():
                os._exit(1)

    threading.Thread(target=watch, name="fnkernel-server-watch", daemon=True).start()


def main() -> None:
    server = os.getppid()
    run_uid, module_name, function_name, req_fd, resp_fd = sys.argv[1:6]
    del sys.argv[4:6]  # the handler sees no descriptor numbers (see above)
    req, resp = int(req_fd), int(resp_fd)
    keep_freed_memory()
    _payloads.convert_on_jemalloc()
    os.set_inheritable(req, False)  # the handler's own subprocesses must not hold our frame pipes
    os.set_inheritable(resp, False)
    _leave_with_the_server(req)
    sys.path.insert(0, os.getcwd())
    _add_packages(os.environ.get(_PACKAGES_ENV, ""))
    # A print is in the log file at once, as on a terminal, for whoever follows the call live
    # (docs/protocol.md, "Live output"); stderr is line-buffered already.
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # a TextIOWrapper
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    function, failure = load_handler(module_name, function_name)
    if failure is not None:
        error_type, message = failure
        body = _bounded(message).encode()
        _write(resp, f"INITFAIL {error_type} {len(body)}\n".encode() + body)
        return
    _write(resp, b"READY\n")
    with os.fdopen(req, "rb", buffering=1 << 20) as requests:
        try:
            serve(function, run_uid, requests, resp, server)
        except EOFError:
            return


if __name__ == "__main__":
    main()
