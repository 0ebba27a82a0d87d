"""What a function ships with it from beside the notebook (docs/protocol.md, "What a handler
sees"): the files ``%%function NAME --include PATH...`` names, and the hints that offer them
when a handler misses one.

A handler's working directory is its Run's files, never the notebook's directory: the cell's
own file, and each included file at the same relative path, so ``import helpers`` and
``open("data/lookup.csv")`` read there as they read beside the notebook.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath

from fnkernel.runtime_server import limits

_SKIPPED = frozenset({"__pycache__", ".git", ".ipynb_checkpoints"})


class IncludeError(ValueError):
    """An ``--include`` path that cannot travel with the function; the message says why."""


def included_files(paths: Iterable[str], base: Path) -> dict[str, str]:
    """{relative path: text} of every file `paths` name (a directory: each file under it),
    read from `base`, the notebook's directory. IncludeError for a path outside it, missing,
    or not UTF-8 text."""
    files: dict[str, str] = {}
    root = base.resolve()
    for given in paths:
        path = (base / given).resolve()
        if not path.is_relative_to(root):
            raise IncludeError(
                f"--include {given}: only files inside the notebook's directory ({base}) travel"
            )
        if not path.exists():
            raise IncludeError(f"--include {given}: no such file or directory in {base}")
        found = [path] if path.is_file() else sorted(_walk(path))
        for file in found:
            name = file.relative_to(root).as_posix()
            try:
                files[name] = file.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise IncludeError(
                    f"--include {given}: {name} is not UTF-8 text; a function's files are text"
                ) from None
    size = sum(len(text.encode()) for text in files.values())
    if size > limits.MAX_PAYLOAD_BYTES:
        largest = sorted(files, key=lambda name: -len(files[name]))[:3]
        raise IncludeError(
            f"--include: {size} bytes in all; a function's files are at most "
            f"{limits.MAX_PAYLOAD_BYTES} (largest: {', '.join(largest)}); read large data "
            "from where the handler runs instead"
        )
    return files


def _walk(directory: Path) -> Iterable[Path]:
    for parent, dirs, names in os.walk(directory):
        dirs[:] = [name for name in dirs if name not in _SKIPPED]
        for name in names:
            yield Path(parent, name)


def local_modules(source: str, base: Path) -> dict[str, str]:
    """The modules the cell imports that are beside the notebook: {module: what --include
    ships it} (``helpers`` → ``helpers.py``, a package → its directory). Nothing for a cell
    that is not Python."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    found = {}
    for name in sorted(names):
        if (base / f"{name}.py").is_file():
            found[name] = f"{name}.py"
        elif (base / name / "__init__.py").is_file():
            found[name] = f"{name}/"
    return found


_MISSING_MODULE = re.compile(r"[Nn]o module named '([\w.]+)'")
_MISSING_FILE = re.compile(r"No such file or directory: '([^']+)'")


def hint(message: str, source: str, shipped: Mapping[str, str], base: Path) -> str:
    """What to add to the ``%%function`` line when `message` (a load failure, or a handler's
    error) says a module or a file beside the notebook was missing; "" otherwise."""
    found = _MISSING_MODULE.search(message)
    if found:
        module = found[1].partition(".")[0]
        include = local_modules(source, base).get(module)
        if include is not None and include.rstrip("/") not in _shipped_tops(shipped):
            return f"{include} is beside the notebook: ship it with --include {include}"
        installed = _kernels_distribution(found[1])
        if installed is not None:
            name, version = installed
            return (
                f"{found[1]} is not installed in the runtime; your kernel has {name} {version}: "
                f"add --requirements {name}=={version}"
            )
    found = _MISSING_FILE.search(message)
    if found:
        relative = PurePosixPath(found[1])
        if not relative.is_absolute() and (base / relative).is_file():
            return f"{relative} is beside the notebook: ship it with --include {relative}"
    return ""


def _kernels_distribution(module: str) -> tuple[str, str] | None:
    """The distribution that gives this kernel's environment `module` (``pandas``,
    ``google.protobuf``: where several share a top-level name, the one with the module's
    files), and its version; None if none does (docs/protocol.md, "Requirements")."""
    from importlib import metadata

    top, _, _ = module.partition(".")
    below = module.replace(".", "/") + "/"
    candidates = metadata.packages_distributions().get(top, [])
    shared = len(candidates) > 1 and "." in module  # a namespace: find the module's files
    for name in candidates:
        if shared and not any(str(p).startswith(below) for p in metadata.files(name) or []):
            continue
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _shipped_tops(shipped: Mapping[str, str]) -> set[str]:
    """The top-level names the shipped files take: ``helpers.py``, ``pkg``."""
    return {PurePosixPath(name).parts[0] for name in shipped}
