"""One ``fnkernel up`` a state dir (README, "CLI"): the lock it holds there, the pid file
``fnkernel down`` reads, and ``fnkernel down`` itself."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import IO

from fnkernel.runtime_server.cli.common import EXIT_FAILURE, EXIT_OK, state_dir_of

UP_FILE = "up.pid"  # in the state dir: the pid of the `fnkernel up` using it, for `fnkernel down`
UP_LOCK_FILE = "up.lock"  # in the state dir: locked by the `fnkernel up` using it
DOWN_WAIT_SECONDS = 120.0  # `fnkernel down` waits this long for `up` to stop its components


class StateDirInUse(Exception):
    """Another ``fnkernel up`` uses the state dir."""


def hold_state_dir(state_dir: Path) -> IO[bytes]:
    """The lock that this ``fnkernel up`` alone uses `state_dir` (held while the file is
    open: the kernel drops it with the process, however it ends); StateDirInUse naming the
    other's pid if another holds it. Two stacks on one state dir share its sockets, token and
    pid file, and the second leaves the first where `fnkernel down` cannot reach it."""
    import fcntl

    from fnkernel.system.private import private_dir

    private_dir(state_dir)  # nothing is written into a state dir that is not ours: NotPrivate
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
    lock = open(os.open(state_dir / UP_LOCK_FILE, flags, 0o600), "rb")  # noqa: SIM115  # held
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        other = up_process(state_dir / UP_FILE)
        by = f" (pid {other})" if other is not None else ""
        raise StateDirInUse(
            f"a stack is already up with the state dir {state_dir}{by}; `fnkernel down "
            f"--state-dir {state_dir}` stops it, or give this one another --state-dir"
        ) from None
    return lock


def down(args: argparse.Namespace) -> int:
    """Stop the ``fnkernel up`` of this state dir as Ctrl-C would, and wait until it is gone."""
    from fnkernel.system.procfs import running
    from fnkernel.system.waiting import wait_for

    state_dir = state_dir_of(args)
    up = up_process(state_dir / UP_FILE)
    if up is None:
        print(f"fnkernel down: no stack is up with the state dir {state_dir}", file=sys.stderr)
        return EXIT_FAILURE
    os.kill(up, signal.SIGTERM)
    # It stops its components, each within its drain timeout, then exits.
    if not wait_for(lambda: not running(up), timeout=DOWN_WAIT_SECONDS, interval=0.05):
        print(f"fnkernel down: pid {up} is still stopping after {DOWN_WAIT_SECONDS:g} s",
              file=sys.stderr)  # fmt: skip
        return EXIT_FAILURE
    print(f"fnkernel down: stopped the stack of {state_dir} (pid {up})")
    return EXIT_OK


def up_process(up_file: Path) -> int | None:
    """The pid in `up_file` if it is a running ``fnkernel ... up`` (not a reused pid); a stale
    file is removed."""
    from fnkernel.system.procfs import running

    try:
        pid = int(up_file.read_text())
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    if running(pid) and b"up" in command and b"fnkernel" in b" ".join(command):
        return pid
    up_file.unlink(missing_ok=True)
    return None
