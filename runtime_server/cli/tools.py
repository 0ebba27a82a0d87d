"""``bench`` (the benchmarks of a source checkout) and ``install`` (the kernelspec)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fnkernel.runtime_server.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
)

if TYPE_CHECKING:
    pass


BENCHMARKS = ("invoke", "gateway", "throughput", "map", "kernel", "krm", "requirements", "idle")


def _bench(args: argparse.Namespace) -> int:
    import subprocess

    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / "__init__.py").is_file():
        print("fnkernel bench: the benchmarks ship with a source checkout", file=sys.stderr)
        return EXIT_USAGE
    names = args.names or list(BENCHMARKS)
    unknown = [name for name in names if name not in BENCHMARKS]
    if unknown:
        print(
            f"fnkernel bench: unknown benchmark {', '.join(unknown)}; "
            f"choose from {', '.join(BENCHMARKS)}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    status = EXIT_OK
    for name in names:
        print(f"== benchmarks.{name}", flush=True)
        done = subprocess.run([sys.executable, "-m", f"benchmarks.{name}"], cwd=root)
        if done.returncode != 0:
            status = EXIT_FAILURE  # a target missed (or the benchmark failed)
    return status


def _install(args: argparse.Namespace) -> int:
    from fnkernel.kernel.install import install

    prefix = sys.prefix if args.sys_prefix else args.prefix
    if not (args.user or prefix):
        # A virtualenv's own share/jupyter is where its Jupyter looks first; else the user's.
        in_venv = sys.prefix != sys.base_prefix
        prefix, args.user = (sys.prefix, False) if in_venv else (None, True)
    path = install(user=args.user, prefix=prefix)
    print(f"installed kernelspec fnkernel (Python 3 (fnkernel)) in {path}")
    return EXIT_OK


def register(commands: Any) -> None:
    """Add the subcommands of this group to `commands` (argparse subparsers)."""
    bench = commands.add_parser(
        "bench",
        help="run the benchmarks (each prints ratios against a floor measured in the same run)",
        description="Run benchmarks from the source checkout; exit 1 if any target is missed.",
    )
    bench.add_argument("names", nargs="*", metavar="NAME", help=f"any of {', '.join(BENCHMARKS)}")
    bench.set_defaults(func=_bench)

    install = commands.add_parser(
        "install",
        help="install the fnkernel kernelspec",
        description="Install the 'fnkernel' kernelspec (display name 'Python 3 (fnkernel)') for "
        "this Python. Default: --sys-prefix inside a virtualenv, else --user.",
    )
    where = install.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="in the user's Jupyter data dir")
    where.add_argument("--sys-prefix", action="store_true", help=f"under {sys.prefix}")
    where.add_argument("--prefix", metavar="P", help="under P/share/jupyter/kernels")
    install.set_defaults(func=_install)
