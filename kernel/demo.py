"""``make demo``: execute a notebook headless through the real fnkernel kernel (nbclient) and print
what each cell produced, as a CI log would show it.

    python -m fnkernel.kernel.demo [NOTEBOOK] [--output EXECUTED.ipynb]
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from fnkernel.kernel.kernel import KERNEL_NAME

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
CELL_TIMEOUT = 120


def read(path: Path) -> nbformat.NotebookNode:
    """The notebook at `path`; ValueError saying why it is none (no such file, not JSON, not
    a notebook)."""
    try:
        return nbformat.read(path, as_version=4)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except (ValueError, nbformat.ValidationError) as exc:  # NotJSONError is a ValueError
        reason = str(exc).splitlines()[0]
        raise ValueError(f"{path} is not a notebook: {reason}") from None


def execute(path: Path, *, cell_timeout: int = CELL_TIMEOUT) -> nbformat.NotebookNode:
    """Run every cell of `path` in a fresh fnkernel kernel (cwd: the notebook's directory);
    raises ``CellExecutionError`` at the first cell that fails, ValueError if it is no
    notebook (``read``)."""
    notebook = read(path)
    client = NotebookClient(
        notebook,
        kernel_name=KERNEL_NAME,
        timeout=cell_timeout,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    return notebook


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def output_text(output: dict[str, Any]) -> str:
    """What an output shows as text, without terminal colours (a CI log is a file)."""
    kind = output["output_type"]
    if kind == "stream":
        text = str(output["text"]).rstrip("\n")
    elif kind in ("execute_result", "display_data"):
        text = str(output["data"].get("text/plain", "")).rstrip("\n")
    elif kind == "error":
        text = "\n".join(output["traceback"])
    else:
        text = ""
    return _ANSI.sub("", text)


def summary(notebook: nbformat.NotebookNode) -> str:
    """Each code cell's first line and its text outputs, indented under it."""
    lines = []
    for number, cell in enumerate(notebook.cells, 1):
        if cell.cell_type != "code":
            continue
        first = cell.source.splitlines()[0] if cell.source else ""
        more = " …" if "\n" in cell.source else ""
        lines.append(f"[{number}] {first}{more}")
        for output in cell.get("outputs", []):
            text = output_text(output)
            if text:
                lines.append(textwrap.indent(text, "    "))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fnkernel.kernel.demo",
        description=__doc__.splitlines()[0] if __doc__ else "",
    )
    parser.add_argument("notebook", nargs="?", type=Path, default=DEFAULT_NOTEBOOK)
    parser.add_argument("--output", type=Path, help="also write the executed notebook here")
    args = parser.parse_args(argv)
    if args.output and not args.output.absolute().parent.is_dir():  # before anything runs
        parser.error(f"--output {args.output}: no such directory")
    try:
        read(args.notebook)  # what is no notebook is said before a kernel starts
    except ValueError as exc:
        parser.error(str(exc))
    print(f"executing {args.notebook} with the {KERNEL_NAME} kernel …", flush=True)
    started = time.monotonic()
    try:
        notebook = execute(args.notebook)
    except CellExecutionError as exc:
        print(f"a cell failed:\n{exc}", file=sys.stderr)
        return 1
    print(summary(notebook))
    print(f"\n{args.notebook.name}: every cell ran in {time.monotonic() - started:.1f} s")
    if args.output:
        nbformat.write(notebook, args.output)
        print(f"executed notebook written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
