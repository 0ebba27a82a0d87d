"""A Runtime Pod's workspace (docs/architecture.md, "Seams": a Run's files travel in the store):
one directory a Run, its files written from the store into a staging sibling renamed into place
when whole, kept while the Run is assigned to the pod.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Collection, Mapping
from pathlib import Path


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
