"""``spawn``: how every fnkernel process starts another fnkernel component."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import IO

from fnkernel.runtime_server.daemon.announce import Child, Log, announced, start
from fnkernel.runtime_server.daemon.prewarmed import Prewarmed, discard
from fnkernel.runtime_server.daemon.server import PARENT_ENV


def spawn(
    args: Sequence[str],
    *,
    stderr: int | IO[str] = subprocess.DEVNULL,
    die_with_parent: bool = False,
    prewarmed: Prewarmed | None = None,
) -> Child:
    """Start ``fnkernel ARGS...`` and wait for its announcement line.

    With `die_with_parent` the child stops itself (SIGTERM, an orderly stop) when this process
    dies (``watch_parent``), so a killed parent (``fnkernel up``, a kernel) leaves no
    orphan behind; and it runs in its own session: a signal to the parent's process group
    (Ctrl-C in a terminal, a kernel interrupt, which ipykernel sends with ``killpg``) stays with
    the parent, which stops its children in order.

    From `prewarmed` (started with die_with_parent) a waiting process runs ARGS, with `stderr`
    appended to by its name; if it fails to announce itself, a fresh process is started.
    """
    argv = [sys.executable, "-m", "fnkernel.runtime_server.cli", *args]
    proc = prewarmed.take(args[0]) if prewarmed is not None else None
    if proc is not None and proc.stdin is not None:
        log = getattr(stderr, "name", None)
        request = {"args": list(args), "stderr": log if isinstance(log, str) else None}
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.close()
            return announced(proc, argv, Log.of(stderr))
        except (OSError, RuntimeError):
            discard(proc)  # it died meanwhile: start afresh
    env = None
    if die_with_parent:
        env = {**os.environ, PARENT_ENV: str(os.getpid())}
    return start(argv, stderr=stderr, env=env, new_session=die_with_parent)
