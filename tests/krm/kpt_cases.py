"""A package written in a test, the command a kpt user types run on it through our CLI, and what
came out: the kpt behaviour tests' shared steps (tests/krm/test_kpt_behaviour.py)."""

from __future__ import annotations

import contextlib
import io
import os
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fnkernel.runtime_server.cli import main
from fnkernel.runtime_server.krm.resources.resourcelist import yaml

DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
spec:
  replicas: 3
"""
CUSTOM = """\
apiVersion: custom.io/v1
kind: Custom
metadata:
  name: custom
spec:
  image: nginx:1.2.3
"""


def kptfile(body: str = "", name: str = "app") -> str:
    return f"apiVersion: kpt.dev/v1\nkind: Kptfile\nmetadata:\n  name: {name}\n" + textwrap.dedent(
        body
    )


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str
    files: dict[str, str]


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if name.endswith(".sh"):
            path.chmod(0o755)
    return root


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): p.read_text()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


@contextlib.contextmanager
def inside(directory: Path) -> Iterator[None]:
    before = Path.cwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(before)


def fnkernel(*argv: str, stdin: str = "") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with (
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        pytest.MonkeyPatch.context() as patch,
    ):
        patch.setattr("sys.stdin", io.StringIO(stdin))
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def twice(tmp_path: Path, files: dict[str, str], *argv: str, stdin: str = "") -> Run:
    """Run `argv` in a fresh copy of the package, twice; both runs must agree."""
    runs = []
    for attempt in ("first", "second"):
        package = write(tmp_path / attempt / "pkg", files)
        with inside(package):
            code, out, err = fnkernel(*argv, stdin=stdin)
        runs.append(Run(code, out, err, snapshot(package)))
    first, second = runs
    assert (first.code, first.files) == (second.code, second.files), "not the same twice"
    return first


def render(tmp_path: Path, files: dict[str, str], *flags: str) -> Run:
    return twice(tmp_path, files, "fn", "render", ".", *flags)


def documents(text: str) -> list[dict]:
    return [d for d in yaml().load_all(text) if d is not None]


def status(run: Run) -> dict:
    return documents(run.files["Kptfile"])[0]["status"]


# A package whose one step is a starlark script that makes or moves resources (docs/krm.md,
# "Where resources are written").
STARLARK = """\
apiVersion: fn.kpt.dev/v1alpha1
kind: StarlarkRun
metadata:
  name: gen
  annotations:
    config.kubernetes.io/local-config: "true"
source: |
{script}"""


def starlark_package(script: str, *, sub: bool = False) -> dict[str, str]:
    where = "db/" if sub else ""
    files = {
        "Kptfile": kptfile(),
        f"{where}Kptfile": kptfile(
            "pipeline:\n  mutators:\n  - image: starlark\n    configPath: gen.yaml\n",
            name="db" if sub else "app",
        ),
        f"{where}gen.yaml": STARLARK.format(script=textwrap.indent(script, "  ")),
        f"{where}resources.yaml": DEPLOYMENT,
    }
    return files
