"""BashAdapter: ``file.function`` handlers, AWS Lambda custom-runtime style (docs/protocol.md, "Adapters").

A long-lived bash runner sources ``file.sh`` once and, for each call, runs the function in itself
with the payload as its one quoted argument (adapters/bash_runner.sh says why not in a forked job).
Neither the handler nor the payload is ever evaluated as shell source or put into a command string.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import ClassVar

from fnkernel.adapters.base import (
    INLINE,
    JSON,
    HandlerResult,
    NextCall,
    Transfer,
    WorkerAdapter,
    resolve_inside,
    send_request,
    stays_inside,
)
from fnkernel.adapters.errors import (
    HANDLER_NOT_FOUND,
    OUTPUT_TOO_LARGE,
    CorruptResponse,
    HandlerError,
    InitError,
    InvalidHandler,
    InvalidInput,
    MemoryLimitExceeded,
    ran_out_of_memory,
)
from fnkernel.adapters.worker import WorkerCall
from fnkernel.adapters.workerprocess import describe_exit

RUNNER_SCRIPT = Path(__file__).with_name("bash_runner.sh")
BASH = shutil.which("bash") or "/bin/bash"
_FUNCTION = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# What bash prints when it cannot allocate (it then exits): "bash: xmalloc: …: cannot allocate N bytes"
_PATH_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
MAX_HANDLER_BYTES = 256


def split_handler(handler: str) -> tuple[str, str]:
    """``path/file.function`` → (``path/file.sh``, ``function``); InvalidHandler if malformed."""
    if len(handler.encode()) > MAX_HANDLER_BYTES:
        raise InvalidHandler(f"longer than {MAX_HANDLER_BYTES} bytes")
    stem, dot, function = handler.rpartition(".")
    if not dot or not stem:
        raise InvalidHandler(f"{handler!r} is not file.function (e.g. greet.handler for greet.sh)")
    if handler.startswith("/"):
        raise InvalidHandler(
            f"{handler!r} is absolute; name a file relative to the working directory"
        )
    parts = stem.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise InvalidHandler(f"{handler!r} must not contain empty, '.' or '..' path parts")
    if not all(_PATH_PART.fullmatch(part) for part in parts):
        raise InvalidHandler(f"{handler!r}: file names may use letters, digits, '_', '.', '-'")
    if not _FUNCTION.fullmatch(function):
        raise InvalidHandler(f"{function!r} is not a bash function name ([A-Za-z_][A-Za-z0-9_]*)")
    return f"{stem}.sh", function


class BashAdapter(WorkerAdapter):
    runtime: ClassVar[str] = "bash"

    @classmethod
    def check_handler(cls, handler: str, working_dir: Path | None) -> None:
        file, _ = split_handler(handler)
        if working_dir is None:
            stays_inside(file)
        else:
            resolve_inside(working_dir, file)

    def _argv(self) -> list[str]:
        file, function = split_handler(self.spec.handler)
        path = resolve_inside(self.spec.working_dir, file)
        if not path.is_file():
            raise InitError(HANDLER_NOT_FOUND, f"{file} does not exist in the working directory")
        return [
            BASH,
            "--noprofile",
            "--norc",
            str(RUNNER_SCRIPT),
            str(path),
            function,
            str(self.scratch),
        ]

    def start(self) -> None:
        try:
            super().start()
        except InitError as exc:
            raise InitError(exc.error_type, self._relative(exc.message)) from None

    def _relative(self, text: str) -> str:
        return text.replace(f"{self.spec.working_dir.resolve()}/", "")

    def invoke(
        self,
        invocation_id: str,
        payload: bytes,
        deadline: float,
        traceparent: str = "",
        content_type: str = JSON,
        transfer: Transfer = INLINE,
        then: NextCall | None = None,
    ) -> HandlerResult:
        if b"\0" in payload:
            # Checked before the frame is sent: a bash argument cannot carry a NUL byte.
            raise InvalidInput("input contains a NUL byte, which a bash argument cannot carry")
        # It takes no files (takes_files): its input is inline, its output too; it queues no
        # call behind another (queues_calls).
        return super().invoke(invocation_id, payload, deadline, traceparent, content_type)

    def _exchange(
        self, call: WorkerCall, payload: bytes, content_type: str, transfer: Transfer
    ) -> tuple[bytes, str, dict[str, str], int]:
        send_request(call, payload, content_type)
        done, status = call.read_header(2)
        if done != b"D" or not status.isdigit():
            raise CorruptResponse(f"its header was {done + b' ' + status!r}")
        return self._result(call, int(status))

    def _ended(self, call: WorkerCall, code: int) -> tuple[bytes, str, dict[str, str], int]:
        """The function ended the runner (`exit N`, `set -e`, `exec`, a signal): that is its status."""
        return self._result(call, code if code >= 0 else 128 - code)

    def _result(self, call: WorkerCall, status: int) -> tuple[bytes, str, dict[str, str], int]:
        outputs = self._read_outputs()
        output = self._read_output()
        if status != 0:
            raise HandlerError(*self._describe_failure(call, status))
        try:
            json.loads(output)
        except ValueError:
            return output, "text/plain; charset=utf-8", outputs, -1
        return output, "application/json", outputs, -1

    def _read_output(self) -> bytes:
        with open(self.scratch / "stdout", "rb") as stdout:
            size = os.fstat(stdout.fileno()).st_size
            if size > self.max_output_bytes:
                raise HandlerError(
                    OUTPUT_TOO_LARGE,
                    f"the handler wrote {size} bytes to stdout; the limit is {self.max_output_bytes}",
                )
            return stdout.read()

    def _read_outputs(self) -> dict[str, str]:
        """Parse the ``key=value`` lines the function appended to ``$FUNCTION_OUTPUTS``."""
        path = self.scratch / "outputs"
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return {}
        data = path.read_bytes()
        path.unlink()  # the next call starts with no outputs
        if size > 64 * 1024:
            raise HandlerError("InvalidOutputs", "$FUNCTION_OUTPUTS holds more than 64 KiB")
        outputs: dict[str, str] = {}
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            key, eq, value = line.partition("=")
            if not eq:
                raise HandlerError(
                    "InvalidOutputs", f"$FUNCTION_OUTPUTS line {number} is not key=value"
                )
            outputs[key] = value
        return outputs

    def _describe_failure(self, call: WorkerCall, status: int) -> tuple[str, str]:
        _, function = split_handler(self.spec.handler)
        call.collect_logs()
        stderr = [line.text for line in call.logs if line.stream == "stderr" and line.text.strip()]
        if self.spec.memory_mb and ran_out_of_memory(stderr):
            raise MemoryLimitExceeded(self.spec.memory_mb)  # bash itself ran out, and exited
        detail = f": {self._relative(stderr[-1])}" if stderr else ""
        if status > 128:
            return "HandlerKilled", f"{function} was {describe_exit(128 - status)}{detail}"
        return "NonZeroExit", f"{function} exited with status {status}{detail}"
