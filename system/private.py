"""Directories and files only this user may touch (README, "Security").

Two kinds of place hold what another local user must not read or replace — tokens, a Run's env,
its handler's source, the worker scratch files:

* **Private temporary directories** named for the process that owns them. A process that is
  SIGKILLed cannot remove its temporary directories (a Runtime Server's worker scratch dirs, a
  kernel's embedded runtime). Each is named ``fnkernel-KIND-PID-XXXXXXXX`` so that the next
  process of the same kind removes those whose owner is gone (`sweep`), as Jupyter does with its
  runtime files: nothing a crash leaves behind outlives the next start.
* **Named directories** (a state dir, its ``workspace/``, ``sock/`` and ``logs/``, the runtime
  dir of gateway files), which may already exist. One that someone else made first is taken as
  theirs: `private_dir` refuses a directory not owned by this user or writable by anyone else,
  and says which and why. A file in one is created 0600 and never through a link
  (`open_private`, `create_private`; `tighten` checks one another library opens): inside a
  directory only we can write, nobody else can have put a file or a link there.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from pathlib import Path

from fnkernel.system.procfs import running

_NOT_OURS = stat.S_IWGRP | stat.S_IWOTH


class NotPrivate(PermissionError):
    """A directory or file meant for this user only is someone else's, or others may write it."""

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


SHARED_MEMORY = Path("/dev/shm")  # a tmpfs on Linux: files there are memory


def memory_base() -> Path | None:
    """Where a temporary directory is memory (SHARED_MEMORY, if this user may write there);
    None: the system temp dir."""
    return SHARED_MEMORY if os.access(SHARED_MEMORY, os.W_OK | os.X_OK) else None


def private_tempdir(kind: str, base: Path | None = None) -> Path:
    """A new 0700 directory in `base` (default: the system temp dir), owned by this process."""
    return Path(tempfile.mkdtemp(prefix=f"fnkernel-{kind}-{os.getpid()}-", dir=base))


def sweep(kind: str, base: Path | None = None) -> int:
    """Remove this user's ``fnkernel-KIND-PID-*`` directories in `base` (default: the system
    temp dir) whose PID is not running; how many.

    A reused PID only keeps a stale directory for longer; a live owner's directory is never
    touched.
    """
    removed = 0
    uid = os.getuid()
    for entry in Path(base or tempfile.gettempdir()).glob(f"fnkernel-{kind}-*-*"):
        pid = entry.name.removeprefix(f"fnkernel-{kind}-").partition("-")[0]
        try:
            if not pid.isdigit() or running(int(pid)) or entry.lstat().st_uid != uid:
                continue
        except OSError:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
            removed += 1
    return removed


def private_dir(path: Path) -> Path:
    """`path`, made 0700 (with its missing parents, 0700 too) if it does not exist; NotPrivate
    if it exists but is not this user's to trust: owned by another user, or writable by its
    group or by others — then they could read what we put there, or replace it (a handler's
    source before a worker loads it). A symlink is followed: the directory it names is the one
    checked."""
    missing = []  # the directories to make, outermost last; each 0700, the parents too
    for directory in (path, *path.parents):
        if directory.exists():
            break
        missing.append(directory)
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=0o700)
    return check_private_dir(path)


def check_private_dir(path: Path) -> Path:
    """`path` if it is a directory this user owns and nobody else may write; NotPrivate (or
    another OSError: it does not exist) if not."""
    found = path.stat()
    if not stat.S_ISDIR(found.st_mode):
        raise NotPrivate(errno.ENOTDIR, "not a directory", str(path))
    me = os.geteuid()
    if found.st_uid != me:
        raise NotPrivate(
            errno.EPERM,
            f"owned by uid {found.st_uid}, not by this user (uid {me}): another user made it "
            "first, and could read or replace what fnkernel keeps there; remove it or choose "
            "another directory",
            str(path),
        )
    if found.st_mode & _NOT_OURS:
        raise NotPrivate(
            errno.EPERM,
            f"mode {stat.S_IMODE(found.st_mode):04o} lets {_who_writes(found.st_mode)} write "
            "into it, and so replace what fnkernel keeps there; chmod 700 it",
            str(path),
        )
    return path


def _who_writes(mode: int) -> str:
    bits = ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "others"))
    return " and ".join(name for bit, name in bits if mode & bit)


def open_private(path: str | Path, flags: int = os.O_WRONLY | os.O_APPEND) -> int:
    """A descriptor of `path`, created 0600 if it does not exist, never through a symlink; an
    existing file of ours with a looser mode (an older fnkernel's) is made 0600. NotPrivate if
    the file is another user's. Also an ``opener`` for ``open()``."""
    fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        _own_it(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_private(path: Path) -> str:
    """The text of the file `path`, never through a symlink, as ``open_private`` checks it: made
    0600 if it is ours and looser (an older store's, or a chmod), NotPrivate if it is another
    user's. FileNotFoundError if there is none (nothing is made)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with open(fd, encoding="utf-8") as source:
        _own_it(source.fileno(), path)
        return source.read()


def create_private(path: Path) -> int:
    """A descriptor of a new file `path` (O_EXCL, 0600, write only). A file of that name left by
    a process of ours that died is removed first; nothing already there is ever written to."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o600)
    except FileExistsError:
        os.unlink(path)
        return os.open(path, flags, 0o600)


def tighten(path: Path) -> None:
    """``open_private``'s checks on an existing file by path, for a file another library holds
    open (SQLite's store): opening and closing a descriptor of our own would drop every POSIX
    lock this process holds on it. Nothing happens if there is no such file."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return
    if _loose(found, path) and stat.S_ISREG(found.st_mode):
        os.chmod(path, 0o600)


def _own_it(fd: int, path: str | Path) -> None:
    if _loose(os.fstat(fd), path):
        os.fchmod(fd, 0o600)


def _loose(found: os.stat_result, path: str | Path) -> bool:
    """NotPrivate if the file is another user's; whether others may read or write it."""
    if found.st_uid != os.geteuid():
        raise NotPrivate(errno.EPERM, f"owned by uid {found.st_uid}, not by this user", str(path))
    return bool(stat.S_IMODE(found.st_mode) & 0o077)
