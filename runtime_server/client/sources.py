"""What the CLI and the magics give a Run as text: ``KEY=VALUE`` pairs (its env, a function's
ConfigMap data) and its source files (``--source``), read for POST /v1/runs."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

_SKIPPED = frozenset({"__pycache__", ".git", ".ipynb_checkpoints"})


def parse_pairs(pairs: Iterable[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings as a dict; ValueError names the first that is not one. (Env of a
    Run, a function's ConfigMap data: the CLI and the magics parse both with it.)"""
    parsed = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{pair!r} is not KEY=VALUE")
        parsed[key] = value
    return parsed


def read_source(path: Path) -> dict[str, str]:
    """A file, or every file under a directory, as {relative path: text} for POST /v1/runs."""
    if path.is_file():
        files = {path.name: path}
    elif path.is_dir():
        files = {}
        for directory, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d not in _SKIPPED)
            for name in sorted(names):
                file = Path(directory, name)
                files[file.relative_to(path).as_posix()] = file
    else:
        raise FileNotFoundError(f"source {path} does not exist")
    texts = {}
    for name, file in files.items():
        try:
            texts[name] = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"source {path}: {name} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                "every file of a Run must be"
            ) from None
    return texts
