"""``make demo``: execute a notebook headless through the real fnkernel kernel (nbclient) and print
what each cell produced, as a CI log would show it.

    python -m fnkernel.kernel.demo [NOTEBOOK] [--output EXECUTED.ipynb] [--timeout SECONDS]
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

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


def execute(path: Path, *, cell_timeout: float = CELL_TIMEOUT) -> nbformat.NotebookNode:
    """Run every cell of `path` in a fresh fnkernel kernel (cwd: the notebook's directory);
    raises ``CellExecutionError`` at the first cell that fails, ValueError if it is no
    notebook (``read``)."""
    notebook = read(path)
    run(notebook, path, cell_timeout)
    return notebook


def run(notebook: nbformat.NotebookNode, path: Path, cell_timeout: float) -> None:
    """Run `notebook`'s cells in place (its outputs are there however far it got): nbclient's
    exceptions for a cell that fails (``CellExecutionError``), runs past `cell_timeout` s
    (``CellTimeoutError``) or a kernel that dies (``DeadKernelError``); KeyboardInterrupt,
    from whatever it raised, once nbclient took a SIGTERM or Ctrl-C."""
    client = NotebookClient(
        notebook,
        kernel_name=KERNEL_NAME,
        timeout=cell_timeout,
        resources={"metadata": {"path": str(path.parent)}},
    )
    try:
        client.execute()
    except BaseException as exc:
        # nbclient takes the signal itself (its loop's handler), and shuts the kernel down: the
        # cell may end interrupted, or the kernel dead first (DeadKernelError, then its own
        # cleanup's AssertionError), by which order they come. What it keeps of the signal
        # says which it was either way.
        if getattr(client, "_async_cleanup_kernel_future", None) is not None:
            raise KeyboardInterrupt("nbclient took a signal") from exc
        raise


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


def summary(notebook: nbformat.NotebookNode, *, ran_only: bool = False) -> str:
    """Each code cell's first line and its text outputs, indented under it (`ran_only`: of
    the cells that ran, as far as a run that stopped early got)."""
    lines = []
    for number, cell in enumerate(notebook.cells, 1):
        if cell.cell_type != "code" or (ran_only and cell.get("execution_count") is None):
            continue
        first = cell.source.splitlines()[0] if cell.source else ""
        more = " …" if "\n" in cell.source else ""
        lines.append(f"[{number}] {first}{more}")
        for output in cell.get("outputs", []):
            text = output_text(output)
            if text:
                lines.append(textwrap.indent(text, "    "))
    return "\n".join(lines)


def _failed(exc: BaseException, timeout: float) -> int:
    """Say in a line or two why the run ended early; its exit code. Whatever nbclient raised
    as it cleaned up after a SIGTERM or Ctrl-C (it handles both, interrupting the cell), the
    run was interrupted (130); an error it does not name is raised as it is."""
    if _interrupted(exc):
        # nbclient's own cleanup, which the signal began, fails again as the run ends; its
        # task's error would be logged at exit ("Task exception was never retrieved").
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        print("interrupted: the notebook did not finish", file=sys.stderr)
        return 130
    if isinstance(exc, CellExecutionError):  # its traceback is in its outputs, shown above
        evalue = _ANSI.sub("", exc.evalue).strip()
        print(f"a cell failed: {exc.ename}" + (f": {evalue}" if evalue else ""), file=sys.stderr)
    elif isinstance(exc, CellTimeoutError):
        print(f"a cell ran past {timeout:g} s (--timeout) and was stopped", file=sys.stderr)
    elif isinstance(exc, DeadKernelError):
        print("the kernel died while a cell ran (killed, or out of memory)", file=sys.stderr)
    else:
        raise exc
    return 1


def _interrupted(exc: BaseException | None) -> bool:
    """Whether `exc`, or one it was raised while handling, is an interrupt: ours, or the
    cell's (nbclient interrupts the kernel on SIGTERM and SIGINT)."""
    while exc is not None:
        if isinstance(exc, KeyboardInterrupt) or (
            isinstance(exc, CellExecutionError) and exc.ename == "KeyboardInterrupt"
        ):
            return True
        exc = exc.__context__
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fnkernel.kernel.demo",
        description=__doc__.splitlines()[0] if __doc__ else "",
    )
    parser.add_argument("notebook", nargs="?", type=Path, default=DEFAULT_NOTEBOOK)
    parser.add_argument(
        "--output",
        type=Path,
        help="also write the executed notebook here (as far as it ran, if a cell failed)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=CELL_TIMEOUT,
        metavar="SECONDS",
        help="how long one cell may run (default %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.output and not args.output.absolute().parent.is_dir():  # before anything runs
        parser.error(f"--output {args.output}: no such directory")
    if not args.timeout > 0:
        parser.error(f"--timeout: seconds above 0, got {args.timeout:g}")
    try:
        notebook = read(args.notebook)  # what is no notebook is said before a kernel starts
    except ValueError as exc:
        parser.error(str(exc))
    print(f"executing {args.notebook} with the {KERNEL_NAME} kernel …", flush=True)
    started = time.monotonic()
    code = 0
    try:
        run(notebook, args.notebook, args.timeout)
    except BaseException as exc:
        # What the cells before it printed is what a CI log needs to say why: shown first.
        print(summary(notebook, ran_only=True), flush=True)
        code = _failed(exc, args.timeout)
    if code == 0:
        print(summary(notebook))
        print(f"\n{args.notebook.name}: every cell ran in {time.monotonic() - started:.1f} s")
    if args.output:
        nbformat.write(notebook, args.output)
        ran = "executed notebook" if code == 0 else "notebook, as far as it ran,"
        print(f"{ran} written to {args.output}", file=sys.stderr if code else sys.stdout)
    return code


if __name__ == "__main__":
    sys.exit(main())
