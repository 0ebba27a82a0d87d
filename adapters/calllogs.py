"""A worker's stdout and stderr, and what one call may log (docs/protocol.md, "Limits", "Live
output").

The worker writes both streams to append-only files in its registration's scratch directory
(``LogFiles``). After each call the supervisor reads what was appended, one log record per
line: of each stream the first and the last half MiB and at most 10,000 lines are kept — read in
two bounded reads, never the whole file — with one line between them saying how much was
dropped. On disk, ``trim_logs`` (the server's reaper, every second) frees what lies between
those halves while a call runs, so a call that prints without end takes its 1 MiB plus what it
wrote in the last second. While a call runs, whoever follows it reads the same files with
``LiveLog``: only then, and on the follower's thread, so a call nobody follows costs nothing
more and the handler never waits for a reader.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

STREAMS = ("stdout", "stderr")
_MAX_LOG_LINE = 4096
_ROTATE_LOG_BYTES = 8 << 20
CALL_LOG_BYTES = 1 << 20  # of each stream, per call: what goes to the server log and memory
CALL_LOG_LINES = 10_000  # of each stream, per call
# What one call's live stream carries, both streams together: a quarter of what a call keeps of
# each stream, so it never reaches what trim_logs frees while the call runs.
LIVE_LOG_BYTES = 256 << 10
LIVE_POLL_SECONDS = 0.05  # how often a follower looks for new lines
# Of a call's lines, the last ones kept with its result, for its caller (the last 4 KiB in its
# answer) and for whoever asks for its log once it is over (docs/protocol.md, "Live output"):
# a quick call's whole log, as a rule; held until the Run's next call ends.
KEPT_LOG_BYTES = 256 << 10
KEPT_LOG_LINES = 10_000
_NOT_KEPT_TEXT = (
    "[fnkernel: {} earlier line(s) of this call are in the stack's log only: its result keeps "
    "its last {} KiB]"
)
# The line that says so, read back: how many were left out.
NOT_KEPT = re.compile(
    re.escape(_NOT_KEPT_TEXT).replace(r"\{\}", r"(\d+)", 1).replace(r"\{\}", r"\d+")
)
# The line that stands for a call's lines dropped from the middle of a stream (_bounded_lines),
# read back: how many lines, when they were counted (a drop by bytes alone counts none).
DROPPED = re.compile(r"\[fnkernel: \d+ bytes(?: \((\d+) lines\))? of (?:stdout|stderr) dropped: ")


def _dropped_text(stream: str, size: int, lines: int) -> str:
    """The line DROPPED reads: `size` bytes of `stream` dropped, `lines` lines (0: uncounted)."""
    what = f"{size} bytes" + (f" ({lines} lines)" if lines else "")
    limit = (
        f"the first and last {CALL_LOG_BYTES >> 11} KiB and {CALL_LOG_LINES} lines of each stream"
    )
    return f"[fnkernel: {what} of {stream} dropped: a call keeps {limit}]"


def lines_in(text: str) -> int | None:
    """How many of a stream's lines the log line `text` stands for: 1, or a dropped middle's
    count; None for a middle dropped by bytes, whose lines nobody counted."""
    dropped = DROPPED.match(text)
    if dropped is None:
        return 1
    return int(dropped[1]) if dropped[1] else None


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2
_BLOCK = 4096
_open_files: weakref.WeakSet[LogFiles] = weakref.WeakSet()  # what trim_logs bounds


@dataclass(frozen=True)
class LogLine:
    stream: str
    text: str
    cut: bool = False  # the line saying a live stream stops here (LiveLog)


def kept_lines(lines: list[LogLine]) -> list[LogLine]:
    """The last of `lines` within KEPT_LOG_BYTES and KEPT_LOG_LINES; when some are left out,
    one line first says how many (a line of an earlier such count is counted, not kept; a
    dropped middle's line counts the lines it stands for)."""
    earlier = 0
    if lines and (found := NOT_KEPT.fullmatch(lines[0].text)):
        earlier, lines = int(found[1]), lines[1:]
    size, start = 0, len(lines)
    while start > 0 and len(lines) - start < KEPT_LOG_LINES:
        size += len(lines[start - 1].text) + 1
        if size > KEPT_LOG_BYTES:
            break
        start -= 1
    if not earlier + start:
        return lines
    left_out = earlier + sum(lines_in(line.text) or 0 for line in lines[:start])
    note = _NOT_KEPT_TEXT.format(left_out, KEPT_LOG_BYTES >> 10)
    return [LogLine("stderr", note), *lines[start:]]


def _log_line(stream: str, raw: bytes) -> LogLine:
    return LogLine(stream, raw[:_MAX_LOG_LINE].decode("utf-8", "replace"))


class LogFiles:
    """One worker's stdout and stderr files, the offset each was read to, and the lock under
    which they are read while the worker lives (``trim`` never touches a descriptor ``close``
    closed)."""

    def __init__(self, scratch: Path) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC
        self.fds = {
            stream: os.open(scratch / f"worker.{stream}", flags, 0o600) for stream in STREAMS
        }
        self.offsets = dict.fromkeys(STREAMS, 0)  # what read has read
        self.lock = threading.Lock()
        self.closed = False
        _open_files.add(self)

    def read(self, ends: Mapping[str, int] | None = None) -> list[LogLine]:
        """The lines appended to stdout/stderr since the last read, bounded (module docstring),
        up to `ends` if given (a call queued behind this one may have begun to write).
        Everything appended counts as read, a last line without its newline included: the call
        it belongs to is over, and a partial line left behind would be read again by every
        later call."""
        lines: list[LogLine] = []
        for stream, fd in self.fds.items():
            offset = self.offsets[stream]
            # The file's size: a quarter of what os.fstat costs, and this runs twice a call. The
            # worker's writes are O_APPEND and ours are preads, so the offset moved is no one's.
            size = _bounded_by(os.lseek(fd, 0, os.SEEK_END), ends, stream)
            if size <= offset:
                continue
            lines += _bounded_lines(stream, fd, offset, size)
            self.offsets[stream] = size
            if size > _ROTATE_LOG_BYTES and ends is None:
                os.ftruncate(fd, 0)  # O_APPEND: the worker's next write lands at offset 0
                self.offsets[stream] = 0
        return lines

    def below_rotation(self) -> bool:
        """Whether neither file is due to be rotated by the next ``read`` to its end."""
        return all(os.lseek(fd, 0, os.SEEK_END) <= _ROTATE_LOG_BYTES for fd in self.fds.values())

    @contextlib.contextmanager
    def sized(self) -> Iterator[list[tuple[str, int, int]]]:
        """Each stream's name, descriptor and size, held open meanwhile (none once closed): for
        the readers beside the supervisor, ``trim`` and ``LiveLog``."""
        with self.lock:
            yield [] if self.closed else [
                (stream, fd, os.lseek(fd, 0, os.SEEK_END)) for stream, fd in self.fds.items()
            ]  # fmt: skip

    def trim(self) -> None:
        """Free on disk what a call in progress appended beyond what ``read`` will keep of
        it: the middle, between its first and last half MiB (a hole: the file keeps its size).
        (In the moment between a worker's answer and its reading, a call queued behind it may
        have written more than half a MiB: the last half MiB of the call that ended would then
        read as a hole. Not guarded.)"""
        half = CALL_LOG_BYTES // 2
        with self.sized() as streams:
            for stream, fd, size in streams:
                offset = self.offsets[stream]
                start = -(-(offset + half) // _BLOCK) * _BLOCK
                end = (size - half) // _BLOCK * _BLOCK
                if end - start >= CALL_LOG_BYTES:  # not for every block: once it is worth it
                    _punch_hole(fd, start, end - start)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            for fd in self.fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)


def trim_logs() -> None:
    """``LogFiles.trim`` for every worker of this process (the reaper calls it)."""
    for files in list(_open_files):
        with contextlib.suppress(OSError):
            files.trim()


class LiveLog:
    """One call's log lines as its handler writes them, for those who follow the call.

    Made by the first follower (``WorkerCall.live_log``); the reads are the followers', every
    LIVE_POLL_SECONDS at most, and once the call's own as it ends (``finish``: the last lines,
    an unterminated one included, before the log files may be rotated). The lines are kept in
    order of reading — within a stream, as written — up to LIVE_LOG_BYTES, where one line says
    that the stream stops there.
    """

    def __init__(self, files: LogFiles, settled: Callable[[], bool] | None = None) -> None:
        """`settled`: whether what the files hold now is surely this call's (asked after their
        sizes are read, before what is new is read); None: always."""
        self._files = files
        self._settled = settled
        self._positions = dict(files.offsets)  # where this call's lines begin
        self._partial = dict.fromkeys(STREAMS, b"")
        self._read_bytes = 0
        self._cond = threading.Condition()
        self.lines: list[LogLine] = []
        self.cut = False  # LIVE_LOG_BYTES reached: no more lines will come
        self.done = False  # the call is over: no more lines will come

    def after(self, index: int, wait: float = LIVE_POLL_SECONDS) -> tuple[list[LogLine], bool]:
        """The lines from `index` on, waiting up to `wait` for some, and whether they are the
        last (the call is over)."""
        with self._cond:
            if not self.done and len(self.lines) <= index:
                self._read(final=False)
                if len(self.lines) <= index and wait > 0:
                    self._cond.wait(wait)  # finish() wakes it
                    if not self.done:
                        self._read(final=False)
            return self.lines[index:], self.done

    def finish(self, ends: Mapping[str, int] | None = None) -> None:
        """The call is over: read what is left (up to `ends`, as ``LogFiles.read``), and wake
        the followers."""
        with self._cond:
            if not self.done:
                self._read(final=True, ends=ends)
                self.done = True
                self._cond.notify_all()

    def _read(self, *, final: bool, ends: Mapping[str, int] | None = None) -> None:
        if self.cut:
            return
        with self._files.sized() as streams:
            if not final and self._settled is not None and not self._settled():
                return  # the call has answered: its last lines come with finish
            for stream, fd, size in streams:
                size = _bounded_by(size, ends, stream)
                position = self._positions[stream]
                budget = LIVE_LOG_BYTES - self._read_bytes
                if size > position and budget <= 0:
                    self._stop_here()
                    return
                wanted = min(size - position, budget)
                chunk = os.pread(fd, wanted, position) if wanted > 0 else b""
                position = self._positions[stream] = position + len(chunk)
                self._read_bytes += len(chunk)
                *complete, partial = (self._partial[stream] + chunk).split(b"\n")
                self.lines += [_log_line(stream, raw) for raw in complete]
                if position < size:  # the budget ran out within this read
                    self._stop_here()
                    return
                if final and partial:  # the call is over: its last line has no newline
                    self.lines.append(_log_line(stream, partial))
                    partial = b""
                self._partial[stream] = partial

    def _stop_here(self) -> None:
        self.cut = True
        self.lines.append(
            LogLine(
                "stderr",
                f"[fnkernel: live output stops after {LIVE_LOG_BYTES >> 10} KiB; "
                "the call's last lines come with its result]",
                cut=True,
            )
        )


def _bounded_by(size: int, ends: Mapping[str, int] | None, stream: str) -> int:
    """A file's `size`, or less where `ends` says the call's lines end (-1: unknown)."""
    end = -1 if ends is None else ends.get(stream, -1)
    return size if end < 0 else min(size, end)


def _bounded_lines(stream: str, fd: int, offset: int, size: int) -> list[LogLine]:
    """The lines of `fd` between `offset` and `size`, keeping the first and the last half of
    CALL_LOG_BYTES and of CALL_LOG_LINES, and between them one line saying what was dropped."""
    appended = size - offset
    half = CALL_LOG_BYTES // 2
    if appended <= CALL_LOG_BYTES:
        head, tail = os.pread(fd, appended, offset), b""
    else:  # two bounded reads, cut at the line ends nearest the middle
        head, tail = os.pread(fd, half, offset), os.pread(fd, half, size - half)
        head = head[: head.rfind(b"\n") + 1] or head
        start = tail.find(b"\n") + 1
        tail = tail[start:] if 0 < start < len(tail) else tail
    dropped = appended - len(head) - len(tail)
    first, last = head.splitlines(), tail.splitlines()
    lines_dropped = len(first) + len(last) - CALL_LOG_LINES
    if lines_dropped > 0:
        every = first + last
        keep = CALL_LOG_LINES // 2
        dropped += sum(len(raw) + 1 for raw in every[keep:-keep])
        first, last = every[:keep], every[-keep:]
    lines = [_log_line(stream, raw) for raw in first]
    if dropped:
        lines.append(LogLine(stream, _dropped_text(stream, dropped, max(0, lines_dropped))))
    lines += [_log_line(stream, raw) for raw in last]
    return lines


def _punch_hole(fd: int, offset: int, length: int) -> None:
    """Deallocate a range of `fd` (``fallocate(PUNCH_HOLE)``); on a file system that cannot,
    nothing happens, and the call's logs stay bounded in memory only."""
    libc = _libc()
    if libc is not None:
        libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    except (OSError, AttributeError):
        return None
    return libc
