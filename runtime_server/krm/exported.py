"""The entry point of an exported KRM function (docs/krm.md, "A notebook function kpt can run").

``fnkernel export`` packs a notebook's ``%%function NAME --krm`` handler into a zipapp with this
module, ``resources/resourcelist.py`` and ruamel.yaml, and nothing else of fnkernel: it reads a
ResourceList on stdin, gives the handler its JSON as the notebook's bridge does, applies what
the handler returns onto the input (so what it left alone keeps its comments and layout) and
writes the ResourceList on stdout. The exit code is the KRM function spec's: 1 when the handler
failed or reported an error result, else 0; the results are written either way.

It imports only the standard library, ruamel.yaml and resourcelist.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import logging
import sys
import traceback
from typing import Any, BinaryIO, TextIO

from fnkernel.runtime_server.krm.resources.resourcelist import (
    InvalidResourceList,
    ResourceList,
    Result,
)

# Where the export puts the function's own files inside the archive: they go last on sys.path,
# so a user module named like one of the standard library's cannot shadow it.
FUNCTION_DIR = "function"


class Context:
    """The second argument of a two-argument handler, as the Python adapter gives it (its
    invocation id and run uid are empty here: there is no Run)."""

    invocation_id = ""
    run_uid = ""

    def __init__(self) -> None:
        self.logger = logging.getLogger("function")
        self.outputs: dict[str, str] = {}

    def remaining_millis(self) -> int:
        return 0  # kpt gives an exec function no deadline of its own

    def set_output(self, key: str, value: object) -> None:
        self.outputs[str(key)] = value if isinstance(value, str) else json.dumps(value)


def load(handler: str) -> Any:
    module_name, _, function_name = handler.rpartition(".")
    return getattr(importlib.import_module(module_name), function_name)


def _takes_context(function: Any) -> bool:
    try:
        inspect.signature(function).bind(None, None)
    except (TypeError, ValueError):
        return False
    return True


def run(handler: str, stdin: BinaryIO, stdout: BinaryIO, stderr: TextIO) -> int:
    """One evaluation; the exit code."""
    try:
        rl = ResourceList.parse(stdin.read())
    except InvalidResourceList as exc:
        print(f"the input is not a ResourceList: {exc}", file=stderr)
        return 1
    try:
        # The handler's prints are its log: stdout carries the ResourceList alone.
        with contextlib.redirect_stdout(stderr):
            function = load(handler)
            payload = json.loads(json.dumps(rl.document, default=str))
            output = function(payload, Context()) if _takes_context(function) else function(payload)
        try:
            rl.apply(output)
        except InvalidResourceList as exc:
            raise TypeError(
                f"the handler must return a ResourceList (a JSON object with items): {exc}"
            ) from None
    except Exception as exc:
        traceback.print_exc(file=stderr)
        rl.add_results([Result(f"{handler} failed: {type(exc).__name__}: {exc}", "error")])
        stdout.write(rl.to_bytes())
        return 1
    stdout.write(rl.to_bytes())
    return 1 if rl.has_errors() else 0


def main(handler: str) -> None:
    """The archive's ``__main__``, once it has put FUNCTION_DIR last on sys.path."""
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    sys.exit(run(handler, sys.stdin.buffer, sys.stdout.buffer, sys.stderr))
