"""Private temporary directories named for the process that owns them.

A process that is SIGKILLed cannot remove its temporary directories (a Runtime Server's worker
scratch dirs, a kernel's embedded runtime). Each is named ``fnkernel-KIND-PID-XXXXXXXX`` so that
the next process of the same kind removes those whose owner is gone (`sweep`), as Jupyter does
with its runtime files: nothing a crash leaves behind outlives the next start.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from adapters.procfs import running


def private_tempdir(kind: str) -> Path:
    """A new 0700 directory in the system temp dir, owned by this process."""
    return Path(tempfile.mkdtemp(prefix=f"fnkernel-{kind}-{os.getpid()}-"))


def sweep(kind: str) -> int:
    """Remove this user's ``fnkernel-KIND-PID-*`` directories whose PID is not running; how many.

    A reused PID only keeps a stale directory for longer; a live owner's directory is never
    touched.
    """
    removed = 0
    uid = os.getuid()
    for entry in Path(tempfile.gettempdir()).glob(f"fnkernel-{kind}-*-*"):
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
