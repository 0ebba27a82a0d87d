"""What a ``%%function`` cell asks for (docs/protocol.md, "Kernel"), and whose the Run it makes
is ("Ownership")."""

from __future__ import annotations

import builtins
import keyword
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from fnkernel.adapters.runtimes import RUNTIMES
from fnkernel.runtime_server import wire
from fnkernel.runtime_server.lifecycle.runs import RunSpec, files_digest


@dataclass(frozen=True)
class Spec:
    """What a ``%%function`` cell asks for; equal specs are the same function."""

    name: str
    runtime: str
    handler: str
    source: str
    env: Mapping[str, str] = field(default_factory=dict)
    # What --include ships beside the cell's file: {relative path: text} (kernel/include.py).
    files: Mapping[str, str] = field(default_factory=dict)
    idle_timeout: int = 0
    memory: int = 0  # MiB (0: the default)
    replicas: int = 1  # Runs serving the function (docs/protocol.md, "Replicas")
    requirements: tuple[str, ...] = ()  # PEP 508 (docs/protocol.md, "Requirements")
    secrets: tuple[str, ...] = ()  # the stack's secrets' names (docs/protocol.md, "Secrets")

    @property
    def filename(self) -> str:
        return f"{self.name}.{RUNTIMES[self.runtime].extension}"

    def name_problem(self) -> str:
        """Why the cell cannot have its name, or "": a keyword cannot be called from a cell,
        and the function bound to a builtin's name would stand in for the builtin in every
        later cell (``print`` calling the function, printing nothing); a Python cell's file,
        first on the handler's import path, would hide a module of the same name from the
        handler and from every library it imports (a standard library module, or a package it
        requires)."""
        if keyword.iskeyword(self.name):  # a soft one (match, type) is a name too
            return f"{self.name} is a Python keyword: a cell could not call it"
        if not self.name.startswith("_") and hasattr(builtins, self.name):
            return (
                f"{self.name} is a Python builtin: the function would stand in for {self.name} "
                "in every later cell"
            )
        if self.filename != f"{self.name}.py":
            return ""
        if self.name in sys.stdlib_module_names:
            hidden = "a module of Python's standard library"
        elif self.name in {_module_name(requirement) for requirement in self.requirements}:
            hidden = "a package it requires"
        else:
            return ""
        return (
            f"{self.name} is {hidden}: the cell's file {self.filename} would hide it from the "
            "handler and the libraries it imports"
        )

    @property
    def all_files(self) -> dict[str, str]:
        """The Run's files: the included ones and the cell's own."""
        return {**self.files, self.filename: self.source}

    @property
    def fingerprint(self) -> str:
        """The digest of the Run spec this cell asks for (``RunSpec.digest``)."""
        return RunSpec(
            runtime=self.runtime,
            handler=self.handler,
            files_sha256=files_digest(self.all_files),
            env=self.env,
            idle_timeout_seconds=self.idle_timeout,
            memory_mb=self.memory,
            replicas=self.replicas,
            requirements=self.requirements,
            secrets=self.secrets,
        ).digest()

    def origin(self, owner: str) -> str:
        """The Run's ``spec.source`` when the kernel `owner` registers this spec."""
        return f"{wire.CELL_SOURCE}{self.fingerprint}{wire.OWNER_MARK}{owner}"


def owner_of(source: str) -> str:
    """Who owns the Run whose ``spec.source`` is `source`, as a refusal names it: the kernel
    that registered it from a cell, else what created it (docs/protocol.md, "Ownership")."""
    if owner := wire.cell_owner(source):
        return owner
    return f"its creator ({source})" if source else "its creator (the CLI or the HTTP API)"


def _module_name(requirement: str) -> str:
    """The name a requirement's distribution is most often imported by (``typing-extensions``
    → ``typing_extensions``)."""
    found = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    return re.sub(r"[-.]+", "_", found[1]).lower() if found else ""
