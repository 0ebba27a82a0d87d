"""A payload read from a file and a result written to one, never held whole on the stack's
machine (docs/protocol.md, "Large payloads"): what ``Client.invoke`` does with ``data=`` given
as a binary file and with ``write_to=``, for the CLI's stdin and ``--output``."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from typing import BinaryIO, Protocol

from fnkernel.runtime_server import payloads

CHUNK_BYTES = 1 << 20  # what is held of a payload or a result while it is copied


class Sink(Protocol):
    """Where a result's bytes are written (``write_to``): an open binary file, or anything
    that takes bytes as one does."""

    def write(self, data: bytes, /) -> object: ...


class FileBody:
    """A request's body read from a regular file as it is sent — its first bytes, read
    already, then the rest a chunk at a time — so that a large payload for a gateway on another
    machine is never held whole. Its length is the file's, known before it is sent."""

    def __init__(self, first: bytes, source: BinaryIO, size: int) -> None:
        self.first, self.source, self.size = first, source, size
        self._rest_at = source.tell()  # where the rest begins, for a body sent again

    def __len__(self) -> int:
        return self.size

    def chunks(self) -> Iterator[bytes]:
        """Its bytes, from the first (each time it is sent); ValueError if the file no longer
        holds as many (the request is then cut short, and the gateway refuses it)."""
        self.source.seek(self._rest_at)
        yield self.first
        sent = len(self.first)
        while sent < self.size and (chunk := self.source.read(min(CHUNK_BYTES, self.size - sent))):
            sent += len(chunk)
            yield chunk
        if sent != self.size:
            raise ValueError(
                f"data= file: {sent} bytes of the {self.size} it had were there to send"
            )


class Counted:
    """`sink`, counting the bytes written to it."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.written = 0

    def write(self, data: bytes, /) -> object:
        taken = self.sink.write(data)
        self.written += len(data)
        return taken


def size_of(source: BinaryIO, read: int) -> int | None:
    """The whole size of a payload read from `source`, of which `read` bytes were read: known
    for a regular file (its size past where it was read to), None for a pipe."""
    try:
        seen = os.fstat(source.fileno())
        return read + seen.st_size - source.tell() if stat.S_ISREG(seen.st_mode) else None
    except (OSError, ValueError, AttributeError):  # no descriptor (an in-memory file): unknown
        return None


def spool_stream(path: str, first: bytes, source: BinaryIO, bounded: Callable[[int], None]) -> int:
    """`first`, then the rest of `source`, written to the new spool file `path` a chunk at a
    time; its size. `bounded(size)` is asked as the file grows (it raises past the stack's
    bound: PayloadTooLarge), so a stream past it is refused once the bound is passed, not when
    it ends; nothing is left at `path` then, nor on any other failure."""
    with payloads.spool_file(path) as out:
        out.write(first)
        written = len(first)
        while chunk := source.read(CHUNK_BYTES):
            written += len(chunk)
            bounded(written)
            out.write(chunk)
    return written


def write_out(sink: Sink, output: bytes, spooled: str = "") -> int:
    """A result's bytes written to `sink` as they came: `output`, or the spool file `spooled`
    a chunk at a time, which is then freed for the next payload (``payloads.release``); how
    many bytes. The file is freed whether or not `sink` took them all (nobody else will read
    it)."""
    if not spooled:
        sink.write(output)
        return len(output)
    written = 0
    try:
        with open(spooled, "rb", buffering=0) as result:
            while chunk := result.read(CHUNK_BYTES):
                sink.write(chunk)
                written += len(chunk)
    finally:
        payloads.release(spooled)
    return written
