"""Whether anything was written to a SQLite store in WAL mode, with no SQL and no system call:
its WAL-index header, mapped once per process (docs/architecture.md, "The proxy hop"). The Run
store's cache of current reads (``SqliteRunStore.fresh``) is emptied whenever it changes.
"""

from __future__ import annotations

import collections
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

# The first copy of the WAL-index header, at the start of the store's -shm file: every commit,
# by any connection, changes it.
WAL_HEADER_BYTES = 48


@dataclass
class _Mapped:
    """One -shm file opened by this process: its header (None if it could not be mapped)."""

    header: mmap.mmap | None
    fd: int
    users: int = 0


class WalHeaders:
    """The WAL-index header of each store file, mapped once per process.

    Closing a descriptor of a file drops every POSIX lock this process holds on that file,
    SQLite's own included (and mmap keeps a duplicate of the one it maps, closed with it). One of
    SQLite's locks on the -shm file tells a new connection that the file is in use; without it,
    the next process to open the store takes itself for the first, truncates the -shm file and
    rebuilds the index under the processes using it (docs/architecture.md, "Measured facts the
    design rests on"). So a -shm file is opened and mapped once, shared by every store of this
    process that reads it, and closed only when the last of them is closed.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mapped: dict[tuple[int, int], _Mapped] = {}  # by the -shm file's (st_dev, st_ino)
        # The keys of collected stores (``give_back``), unmapped by the next map or unmap.
        self._given_back: collections.deque[tuple[int, int]] = collections.deque()

    def map(self, path: Path) -> tuple[tuple[int, int], mmap.mmap | None] | None:
        """The header of `path`'s -shm file and the key to give back to ``unmap``; None if there
        is no -shm file. The mapping is None if the file could not be mapped."""
        shm = f"{path}-shm"
        with self._lock:
            self._settle()
            try:
                found = os.stat(shm)
            except OSError:
                return None
            key = (found.st_dev, found.st_ino)
            entry = self._mapped.get(key)
            if entry is None:
                try:
                    fd = os.open(shm, os.O_RDONLY)
                except OSError:
                    return None
                try:
                    header = mmap.mmap(fd, WAL_HEADER_BYTES, mmap.MAP_SHARED, mmap.PROT_READ)
                except (OSError, ValueError):
                    header = None  # the descriptor stays open all the same: see above
                entry = self._mapped[key] = _Mapped(header, fd)
            entry.users += 1
            return key, entry.header

    def unmap(self, key: tuple[int, int]) -> None:
        """One store of this process no longer reads the header; the last one closes the file."""
        with self._lock:
            self._settle()
            self._release(key)

    def give_back(self, key: tuple[int, int]) -> None:
        """``unmap``, for a store the garbage collector took. The collector runs a finalizer in
        whichever thread allocates when it runs, this one's ``map`` too, while it holds the
        lock: so the key is only noted here, and the next ``map`` or ``unmap`` of this process
        unmaps it. Waiting for the lock there had hung a thread for good (a test's, until its
        timeout)."""
        self._given_back.append(key)

    def _settle(self) -> None:
        while self._given_back:
            self._release(self._given_back.popleft())

    def _release(self, key: tuple[int, int]) -> None:
        entry = self._mapped[key]
        entry.users -= 1
        if entry.users == 0:
            del self._mapped[key]
            if entry.header is not None:
                entry.header.close()
            os.close(entry.fd)


WAL_HEADERS = WalHeaders()
