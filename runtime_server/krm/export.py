"""``fnkernel export`` / ``%krm export``: a notebook's KRM function as one executable file
(docs/krm.md, "A notebook function kpt can run").

The file is a Python zipapp with ``#!/usr/bin/env python3``: the function's own files under
``function/``, ``krm/exported.py`` as its entry point, ``resources/resourcelist.py`` and the
ruamel.yaml it needs. It runs wherever a Python 3 is, without fnkernel installed: as ``kpt fn
eval --exec``, a Kptfile ``exec:`` step, our ``fnkernel fn eval --exec`` or a kustomize exec KRM
function.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

import ruamel.yaml

from fnkernel.runtime_server.krm import exported
from fnkernel.runtime_server.krm.resources import resourcelist

SHEBANG = b"#!/usr/bin/env python3\n"
# The fnkernel modules the archive holds, at their own import paths (empty packages above them).
_MODULES = {
    "fnkernel/runtime_server/krm/exported.py": Path(exported.__file__),
    "fnkernel/runtime_server/krm/resources/resourcelist.py": Path(resourcelist.__file__),
}
_PACKAGES = (
    "fnkernel",
    "fnkernel/runtime_server",
    "fnkernel/runtime_server/krm",
    "fnkernel/runtime_server/krm/resources",
)
_MAIN = """\
import os, sys
sys.path.append(os.path.join(os.path.dirname(__file__), {function_dir!r}))
from fnkernel.runtime_server.krm.exported import main
main({handler!r})
"""


class ExportError(ValueError):
    """The function cannot be exported (not a Python function, a bad file name)."""


def export(name: str, runtime: str, handler: str, files: Mapping[str, str], out: Path) -> Path:
    """Write the function `name` (its `runtime`, `handler` and source `files`) to `out` as an
    executable zipapp, atomically; `out` is returned."""
    if runtime != "python":
        raise ExportError(
            f"{name} is a {runtime} function: only Python functions can be exported "
            "(a KRM function's handler takes and returns a ResourceList)"
        )
    for path in files:
        parts = PurePosixPath(path).parts
        if PurePosixPath(path).is_absolute() or ".." in parts or not parts:
            raise ExportError(f"{name}: file {path!r} is not a relative path inside the function")
    out = out.resolve()
    descriptor, staged = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(descriptor, "wb") as stream:
            stream.write(SHEBANG)
            with zipfile.ZipFile(stream, "w", zipfile.ZIP_DEFLATED) as archive:
                _fill(archive, handler, files)
        os.chmod(staged, 0o755)
        os.replace(staged, out)
    except BaseException:
        Path(staged).unlink(missing_ok=True)
        raise
    return out


def _fill(archive: zipfile.ZipFile, handler: str, files: Mapping[str, str]) -> None:
    main = _MAIN.format(function_dir=exported.FUNCTION_DIR, handler=handler)
    archive.writestr("__main__.py", main)
    for package in _PACKAGES:
        archive.writestr(f"{package}/__init__.py", "")
    for target, source in _MODULES.items():
        archive.write(source, target)
    yaml_dir = Path(ruamel.yaml.__file__).parent
    archive.writestr("ruamel/__init__.py", "")  # zipimport finds no namespace package
    for source in sorted(yaml_dir.rglob("*.py")):
        archive.write(source, f"ruamel/yaml/{source.relative_to(yaml_dir).as_posix()}")
    for path, text in sorted(files.items()):
        archive.writestr(f"{exported.FUNCTION_DIR}/{path}", text)
