"""The functions an earlier kernel of this notebook registered in its embedded runtime, which
ended with it (docs/protocol.md, "Kernel"): a NameError for one of them says so, and how to keep
functions across a restart.

The record is one small file per notebook in the runtime dir (0600), named for what a restart
keeps: the notebook's path (JupyterLab's ``JPY_SESSION_NAME``), else the kernel's connection file.
It is written when a function is registered in an embedded runtime or unregistered, read on a
NameError only, and removed when a kernel known by its connection file alone shuts down for good.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fnkernel.runtime_server import tokens

SESSION_ENV = "JPY_SESSION_NAME"  # the notebook's path, in a kernel jupyter-server starts


def _identity() -> str:
    """What a kernel restart keeps: the notebook's path, else the connection file ("" if none)."""
    name = os.environ.get(SESSION_ENV, "")
    if not name:
        with contextlib.suppress(Exception):  # not in a kernel (a plain IPython shell)
            from ipykernel.connect import get_connection_file

            name = get_connection_file()
    return hashlib.sha256(name.encode()).hexdigest()[:24] if name else ""


class PreviousKernel:
    """This notebook's functions in embedded runtimes, and which kernel (pid) registered each."""

    def __init__(self, directory: Path | None = None) -> None:
        self._directory = directory

    @functools.cached_property
    def path(self) -> Path | None:
        """The record's file; found on first use, not at kernel start."""
        identity = _identity()
        if not identity:
            return None
        return (self._directory or tokens.runtime_dir()) / f"notebook-{identity}.json"

    def _read(self) -> dict[str, int]:
        if self.path is None:
            return {}
        try:
            record = json.loads(self.path.read_text())
            return {str(name): int(pid) for name, pid in record.items()}
        except (OSError, ValueError, TypeError, AttributeError):  # none yet, or not ours
            return {}

    def _write(self, record: dict[str, int]) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):  # a hint, never a failure of the cell
                tokens.write_private(self.path, json.dumps(record))

    def remember(self, name: str) -> None:
        record = self._read()
        if record.get(name) != os.getpid():
            self._write({**record, name: os.getpid()})

    def forget(self, name: str) -> None:
        record = self._read()
        if name in record:
            del record[name]
            self._write(record)

    def ended(self, restart: bool) -> None:
        """The kernel is shutting down (`restart`: to start again with the same identity). A
        kernel known by its connection file alone (no notebook: nbclient's, a console's) has no
        next kernel to tell unless it restarts, so its record goes with it."""
        if restart or os.environ.get(SESSION_ENV) or self.path is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()

    def hint(self, name: str) -> str | None:
        """Why `name` is gone, if an earlier kernel of this notebook registered it."""
        pid = self._read().get(name)
        if pid is None or pid == os.getpid():
            return None
        return (
            f"{name} was a function of this notebook's previous kernel, registered in its "
            "embedded runtime, which ended with that kernel. Run its %%function cell again; to "
            "keep functions across restarts, register them on a shared stack (fnkernel up, "
            f"then %fn_connect URL) and bind them in a new kernel with %use {name}."
        )


def name_error_handler(
    previous: PreviousKernel, on_stack: Callable[[str], str | None] = lambda name: None
) -> Any:
    """An IPython custom exception handler: a NameError for a previous kernel's function, or
    for a function on the kernel's shared stack (`on_stack`), is shown with the hint as a note
    (PEP 678), as IPython shows any error."""

    def handler(
        shell: Any, etype: type, value: BaseException, tb: Any, tb_offset: Any = None
    ) -> Any:
        name = getattr(value, "name", None)
        hint = (previous.hint(name) or on_stack(name)) if isinstance(name, str) else None
        if hint is not None and hint not in getattr(value, "__notes__", ()):
            value.add_note(hint)
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)

    return handler
