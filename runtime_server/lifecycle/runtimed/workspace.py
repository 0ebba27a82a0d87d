"""A Runtime Pod's workspace (docs/architecture.md, "Seams": a Run's files travel in the store):
one directory a Run, its files written from the store into a staging sibling renamed into place
when whole, kept while the Run is assigned to the pod; and the registration digest, computed
from what was written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from fnkernel.runtime_server import limits
from fnkernel.runtime_server.lifecycle.runs import (
    Run,
)

_SKIPPED_DIRS = frozenset({"__pycache__"})


class Workspace:
    """The directory of one pod's Runs' files: ``root/RUN_UID`` each."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    def working_dir(self, uid: str) -> Path:
        """Where the files of Run `uid` are while it is assigned to this pod."""
        return self.root / uid

    def materialize(self, uid: str, files: Callable[[], Mapping[str, str]]) -> Path:
        """The Run's working dir, its files (`files()`) written if it does not exist yet: a
        directory that exists is kept, as the handler may have written into it."""
        directory = self.working_dir(uid)
        if not directory.is_dir():
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_files(files(), directory)
        return directory

    def remove_all_but(self, kept: Collection[str]) -> None:
        """Remove the directory of every Run not in `kept` (a staging directory too)."""
        try:
            entries = list(self.root.iterdir())
        except OSError:  # none yet, or not a directory: materialize says so per Run
            return
        for entry in entries:
            uid = entry.name.lstrip(".").split(".", 1)[0]
            if uid not in kept:
                shutil.rmtree(entry, ignore_errors=True)


def source_tree_hash(working_dir: Path) -> str:
    """SHA-256 over every file's relative path, executable bit and content (sorted)."""
    tree = hashlib.sha256()
    for directory, dirs, files in os.walk(working_dir):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS)
        for name in sorted(files):
            path = Path(directory, name)
            relative = path.relative_to(working_dir).as_posix()
            executable = os.access(path, os.X_OK)
            tree.update(f"{relative}\0{int(executable)}\0".encode())
            tree.update(hashlib.sha256(path.read_bytes()).digest())
    return tree.hexdigest()


def write_files(files: Mapping[str, str], directory: Path) -> None:
    """Write a Run's files into `directory`, which must not exist: into a sibling first, renamed
    into place once all are written, so a directory that exists holds every file."""
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        for name, text in files.items():
            target = staging / name
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                target.write_text(text)
            except OSError as exc:  # a failed write (ENOSPC) names no file by itself
                raise OSError(exc.errno, exc.strerror, str(directory / name)) from None
        staging.chmod(0o700)
        staging.rename(directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def registration_digest(run: Run, working_dir: Path) -> str:
    """docs/protocol.md: lowercase SHA-256 of the canonical, immutable registration inputs — the resolved
    source identity, handler, environment and runtime-visible settings; never the working-dir
    path, so two working dirs with the same inputs give the same digest."""
    canonical = {
        "source": source_tree_hash(working_dir),
        "handler": run.handler,
        "env": run.env,
        "runtime": run.runtime,
        "idleTimeoutSeconds": run.idle_timeout_seconds,
        "memoryMb": limits.check_memory_mb(run.memory_mb),
    }
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return limits.sha256_digest(text.encode())
