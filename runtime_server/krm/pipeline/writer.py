"""Writing a package's new files all or nothing (``write_package``)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from fnkernel.runtime_server.krm.pipeline.steps import Outcome, PipelineError
from fnkernel.runtime_server.krm.resources.package import read_resources, render_files


def changed(path: str, before: str | None, after: str) -> bool:
    """Whether a function changed the file: its new text differs from what it was, and from
    what it was as ruamel.yaml writes it (a block scalar's indentation, say, is normalized even
    when nothing touched the resource — that alone is no reason to rewrite a file)."""
    if before is None or before == after:
        return before is None
    return render_files(read_resources(before, path)).get(path) != after


def write_package(
    root: Path, outcome: Outcome, *, prune: bool = True, dry_run: bool = False
) -> None:
    """Write the changed files and (with `prune`) remove the emptied ones, all or nothing: every
    new text is staged beside its file first; only then are they renamed into place, with what
    they replace kept aside until the last one is in, so that a failure (or Ctrl-C) on the way
    puts every file back as it was. Each path must stay inside `root`. `outcome.written` and
    `removed` list them — with `dry_run`, what would be, nothing written."""
    root = root.resolve()
    changes: list[tuple[str, Path, str | None]] = []  # (path, target, new text or None: remove)
    paths = set(outcome.before) | set(outcome.after) if prune else set(outcome.after)
    for path in sorted(paths):
        text = outcome.after.get(path)
        if text is not None and not changed(path, outcome.before.get(path), text):
            continue
        target = root / path
        if not target.parent.resolve().is_relative_to(root):
            raise PipelineError(f"a function wrote {path}, outside the package", outcome.steps)
        if target.is_symlink():  # never read (package.py), so never written through either
            raise PipelineError(f"a function wrote {path}, which is a symlink", outcome.steps)
        changes.append((path, target, text))
    if not dry_run:
        _apply(changes, outcome)
    for path, _, text in changes:
        (outcome.written if text is not None else outcome.removed).append(path)


def _apply(changes: list[tuple[str, Path, str | None]], outcome: Outcome) -> None:
    staged: dict[Path, Path] = {}
    try:
        for _, target, text in changes:
            if text is not None:
                target.parent.mkdir(parents=True, exist_ok=True)
                staged[target] = stage(target, text)
        with _signals_held():
            _commit(changes, staged)
    except OSError as exc:
        raise PipelineError(
            f"writing the package failed, every file is as it was: {exc}", outcome.steps
        ) from None
    finally:
        for temporary in staged.values():
            temporary.unlink(missing_ok=True)


def stage(target: Path, text: str) -> Path:
    temporary = target.with_name(f".{target.name}.fnkernel-tmp")
    with temporary.open("w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    if target.exists():
        temporary.chmod(target.stat().st_mode & 0o7777)  # a rewrite keeps the file's mode
    return temporary


def _commit(changes: list[tuple[str, Path, str | None]], staged: dict[Path, Path]) -> None:
    """Rename the staged files into place and remove the removed ones; on any failure undo
    what was done, in reverse."""
    done: list[tuple[Path, Path | None]] = []  # (target, where its old content was kept)
    try:
        for _, target, text in changes:
            kept = None
            if target.exists():
                kept = target.with_name(f".{target.name}.fnkernel-old")
                os.replace(target, kept)
            done.append((target, kept))
            if text is not None:
                os.replace(staged[target], target)
                del staged[target]
    except BaseException:
        for target, kept in reversed(done):
            if kept is not None:
                os.replace(kept, target)
            else:
                target.unlink(missing_ok=True)
        raise
    for _, kept in done:
        if kept is not None:
            kept.unlink(missing_ok=True)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold Ctrl-C, SIGTERM and SIGHUP while the renames run (a few microseconds), so that they
    cannot stop the process half way; they are delivered right after. (Only the main thread can
    hold them; elsewhere an interrupt still unwinds through the undo in ``_commit``.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
