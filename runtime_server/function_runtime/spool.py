"""Payloads past one message's bound, on the Runtime Server's node (docs/protocol.md, "Large
payloads"): a private directory (0700; on one machine a tmpfs, so a file here is memory that
the caller writes once and the worker maps), a file each, named by a random token.

- An **input** arrives as a file: streamed in by ``PutPayload`` (a caller on another machine,
  through the gateway and runtimed), or written here by a caller on the same machine. A call
  names it in ``x-fn-input-ref``; the server removes it when that call ends, however it
  ends.
- An **output** past the size the caller asked for (``x-fn-output-ref-from``) is written here by
  the worker, and the call's trailer names it. The caller reads it, by ``TakePayload`` or from
  the file, and it is removed then.
- A payload read, and mapped by nothing, is kept as a free file whose pages the next payload
  written here reuses (``payloads.spool_file``, ``payloads.release``; docs/protocol.md, "Pages
  written again").
- What nobody claimed — a caller that wrote an input and died, an output never taken — is
  removed once it is SPOOL_GRACE_SECONDS old (``sweep``, every SWEEP_SECONDS), and with the
  directory when the stack stops.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from fnkernel.runtime_server.errors import InvalidField
from fnkernel.runtime_server.payloads import FREE_PREFIX, expire_free_files, release, spool_file
from fnkernel.system.private import private_dir

SPOOL_GRACE_SECONDS = 600.0
SWEEP_SECONDS = 60.0  # how often a Runtime Server sweeps its spool (``start_sweeping``)
CHUNK_BYTES = 1 << 20  # what one message of PutPayload and TakePayload carries
_NAME = re.compile(r"(in|out)-[A-Za-z0-9_-]{22}")
_SWEPT = re.compile(rf"(in|out)-[A-Za-z0-9_-]{{22}}|{FREE_PREFIX}[A-Za-z0-9_-]+")


def new_name(kind: str) -> str:
    """A fresh payload name: ``in-…`` or ``out-…`` and 128 random bits."""
    return f"{kind}-{secrets.token_urlsafe(16)}"


def spool_dir(given: Path) -> Path:
    """The spool inside the directory `given` (``--spool``): a directory of its own, made 0700,
    as `given` may be a pod's emptyDir, which every user may write."""
    return given / "payloads"


class Spool:
    """The spool in `given` (``spool_dir``), holding payloads of at most `max_bytes` each."""

    def __init__(self, given: Path, max_bytes: int) -> None:
        self.directory = private_dir(spool_dir(given))
        self.max_bytes = max_bytes

    def path(self, name: str, field: str = "name") -> Path:
        """Where the payload `name` is (it may not exist); InvalidField naming `field` for a
        name that is not one of ours, so nothing outside the spool is ever named."""
        if not _NAME.fullmatch(name):
            raise InvalidField(field, f"{name[:64]!r} is not a spooled payload's name")
        return self.directory / name

    def existing(self, name: str, field: str) -> tuple[Path, int]:
        """The payload `name`, which must be here: its path and size."""
        path = self.path(name, field)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise InvalidField(field, f"no spooled payload {name} (taken, or removed)") from None
        if size > self.max_bytes:
            self.remove(name)
            raise InvalidField(field, f"{size} bytes; at most {self.max_bytes}")
        return path, size

    def put(self, size: int, chunks: Iterable[bytes]) -> str:
        """Spool an input of `size` bytes, written from `chunks` as they come; its name. Nothing
        is left of it if they are fewer or more bytes than `size`, or the caller goes."""
        if not 0 <= size <= self.max_bytes:
            raise InvalidField("size", f"{size} bytes; at most {self.max_bytes}")
        name = new_name("in")
        written = 0
        private_dir(self.directory)  # made again if the stack removed it as it stopped
        with spool_file(str(self.path(name)), size) as out:
            for chunk in chunks:
                written += len(chunk)
                if written > size:
                    raise InvalidField("data", f"more than the {size} bytes the size said")
                out.write(chunk)
            if written != size:
                raise InvalidField("data", f"{written} bytes, not the {size} the size said")
        return name

    def take(self, name: str, field: str = "name") -> Iterator[bytes]:
        """The payload `name` in chunks; it is gone once read (kept for the next payload,
        ``release``), or removed if the reader stops."""
        path, size = self.existing(name, field)
        try:
            with open(path, "rb") as source:
                while chunk := source.read(CHUNK_BYTES):
                    yield chunk
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        release(str(path), size)

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError, InvalidField):
            self.path(name).unlink()

    def drop_free_files(self) -> None:
        """Remove every free file (``release``): a stopping server's, as its stack goes — with
        its kernel killed, say, when nothing else would until the next stack starts."""
        expire_free_files(str(self.directory), unused_for=0.0)

    def start_sweeping(
        self, stop: threading.Event, every: float = SWEEP_SECONDS
    ) -> threading.Thread:
        """``sweep`` every `every` seconds until `stop` (the Runtime Server's, while it serves):
        whichever way payloads come — PutPayload, or a caller on this machine writing files —
        what nobody claimed goes."""

        def loop() -> None:
            while not stop.wait(every):
                self.sweep()

        thread = threading.Thread(target=loop, name="spool-sweep", daemon=True)
        thread.start()
        return thread

    def sweep(self, now: float | None = None) -> int:
        """Remove what is SPOOL_GRACE_SECONDS old and nobody claimed, how many; and the free
        files unused for a minute (``expire_free_files``)."""
        expire_free_files(str(self.directory))
        now = time.time() if now is None else now
        removed = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.directory):
                with contextlib.suppress(OSError):
                    if (
                        _SWEPT.fullmatch(entry.name)
                        and now - entry.stat(follow_symlinks=False).st_mtime > SPOOL_GRACE_SECONDS
                    ):
                        os.unlink(entry.path)
                        removed += 1
        return removed
