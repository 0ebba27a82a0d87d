"""PythonAdapter: ``module.function`` handlers in a long-lived worker (docs/protocol.md, "Adapters")."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import ClassVar

from fnkernel.adapters import _payloads
from fnkernel.adapters.base import Transfer, WorkerAdapter, resolve_inside, send_request
from fnkernel.adapters.calllogs import STREAMS
from fnkernel.adapters.errors import (
    OUTPUT_TOO_LARGE,
    CorruptResponse,
    HandlerError,
    InvalidHandler,
    InvalidInput,
    MemoryLimitExceeded,
)
from fnkernel.adapters.worker import WorkerCall

WORKER_SCRIPT = Path(__file__).with_name("_python_worker.py")
# A registration's env names here its requirements' directory, which the worker puts on sys.path
# ahead of site-packages (docs/protocol.md, "Requirements"; the worker spells it too).
PACKAGES_ENV = "FNKERNEL_PACKAGES"
# docs/protocol.md, "Limits": dotted identifiers, at least module.function, at most 256 bytes.
_HANDLER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
MAX_HANDLER_BYTES = 256


class PythonAdapter(WorkerAdapter):
    """Imports the handler once per worker; calls ``fn(event)`` or ``fn(event, context)``."""

    runtime: ClassVar[str] = "python"
    content_types: ClassVar[tuple[str, ...]] = _payloads.MEDIA_TYPES
    takes_files: ClassVar[bool] = True
    queues_calls: ClassVar[bool] = True

    @classmethod
    def check_handler(cls, handler: str, working_dir: Path | None) -> None:
        if len(handler.encode()) > MAX_HANDLER_BYTES:
            raise InvalidHandler(f"longer than {MAX_HANDLER_BYTES} bytes")
        if not _HANDLER.fullmatch(handler):
            raise InvalidHandler(
                f"{handler!r} is not module.function (dotted Python identifiers, e.g. handler.handle)"
            )
        # A module file or package in the working directory must not lead out of it.
        top = handler.split(".", 1)[0]
        if working_dir is None:  # no files yet: a dotted identifier names nothing outside
            return
        for candidate in (f"{top}.py", top):
            if (working_dir / candidate).is_symlink() or (working_dir / candidate).exists():
                resolve_inside(working_dir, candidate)

    def _argv(self) -> list[str]:
        module, _, function = self.spec.handler.rpartition(".")
        # -P: the worker script's directory is not put on sys.path; it adds the working directory.
        return [
            sys.executable,
            "-P",
            str(WORKER_SCRIPT),
            self.spec.run_uid,
            module,
            function,
        ]

    def _environment(self) -> dict[str, str]:
        env = super()._environment()
        env.setdefault("PYTHONDONTWRITEBYTECODE", "1")  # keep the working directory as registered
        return env

    def _exchange(
        self, call: WorkerCall, payload: bytes, content_type: str, transfer: Transfer
    ) -> tuple[bytes, str, dict[str, str], int]:
        send_request(call, payload, content_type, transfer)
        status, meta_len, output_len, code, where, *ends = call.read_header(7)
        try:
            call.log_ends = dict(zip(STREAMS, map(int, ends), strict=True))
            media = _payloads.MEDIA_OF[code]
            if where not in (b"inline", b"spooled") or (
                where == b"spooled" and not transfer.output
            ):
                raise ValueError("where")
            size, raw_meta = int(output_len), call.read_exact(int(meta_len))
            meta = json.loads(raw_meta) if raw_meta else {}  # none: the common ok, no outputs
            if status == b"ok":
                if not isinstance(meta, dict):
                    raise ValueError("outputs")
            elif status in (b"invalid", b"error"):
                message, error_type = str(meta["errorMessage"]), str(meta.get("errorType", ""))
            else:
                raise ValueError(status)
        except (ValueError, KeyError, TypeError) as exc:  # the nonce was right, the rest is not
            raise CorruptResponse(f"a malformed answer: {type(exc).__name__}") from None
        if where == b"spooled":  # the worker wrote it to the spool: nothing follows
            return b"", media, meta, size
        if size > self.max_output_bytes:
            call.skip(size)
            raise HandlerError(
                OUTPUT_TOO_LARGE,
                f"the handler returned {size} bytes; the limit is {self.max_output_bytes}",
            )
        output = call.read_exact(size)
        if status == b"ok":
            return output, media, meta, -1
        self._skipped(call)
        if status == b"invalid":
            raise InvalidInput(message)
        if error_type == "MemoryError" and self.spec.memory_mb:
            raise MemoryLimitExceeded(self.spec.memory_mb)
        raise HandlerError(error_type, message)

    @staticmethod
    def _skipped(call: WorkerCall) -> None:
        """`call` failed: the worker skips a call queued behind it to run only after an ok
        (``WorkerCall.then_if_ok``), and answers so at once; read that answer."""
        behind = call.behind
        if behind is None or not call.then_if_ok:
            return
        status, *_ = behind.read_header(7)
        if status != b"skipped":
            raise CorruptResponse(f"the call queued behind it was answered {status!r}")
        call.behind = None  # nothing runs behind it: its lines end where the files do
