"""The built-in runtimes: the one list every part that names a runtime reads (docs/architecture.md,
"Adding a runtime").

Standard library only: the kernel reads it at start (``%%function --runtime``, the handler file's
extension, how a failure's traceback maps onto cell lines) and must not load an adapter for that;
``adapter()`` imports the adapter class on first use.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fnkernel.adapters.base import Adapter


@dataclass(frozen=True)
class Traceback:
    """How a runtime's worker logs a handler's failure: the line that starts the traceback, a
    pattern for one frame with the groups ``path``, ``line`` and ``function``, and the lines
    that join the tracebacks of a chain of exceptions (``raise ... from``), each of which
    starts with `start` again."""

    start: str
    frame: re.Pattern[str]
    chained: tuple[str, ...] = ()


@dataclass(frozen=True)
class BuiltinRuntime:
    """One built-in runtime: what registers, serves and shows its handlers."""

    name: str  # RegisterFunctionRequest's runtime, a Run's spec.runtime, a Runtime Pod's image
    extension: str  # the handler file a %%function cell becomes: NAME.<extension>
    adapter_path: str  # "module:Class" of its Adapter
    traceback: Traceback | None = None  # None: its failures carry no frames to map

    def adapter(self) -> type[Adapter]:
        name = self.adapter_path.partition(":")[2]
        cls: type[Adapter] = getattr(importlib.import_module(self.adapter_module), name)
        return cls

    @property
    def adapter_module(self) -> str:
        return self.adapter_path.partition(":")[0]


RUNTIMES: dict[str, BuiltinRuntime] = {
    runtime.name: runtime
    for runtime in (
        BuiltinRuntime(
            "python",
            extension="py",
            adapter_path="fnkernel.adapters.python:PythonAdapter",
            traceback=Traceback(
                start="Traceback (most recent call last):",
                frame=re.compile(
                    r'\s*File "(?P<path>[^"]*)", line (?P<line>\d+), in (?P<function>.*)'
                ),
                chained=(
                    "The above exception was the direct cause of the following exception:",
                    "During handling of the above exception, another exception occurred:",
                ),
            ),
        ),
        BuiltinRuntime("bash", extension="sh", adapter_path="fnkernel.adapters.bash:BashAdapter"),
    )
}


class UnknownRuntime(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"must be one of {', '.join(RUNTIMES)}, got {name!r}")
        self.name = name


def runtime(name: str) -> BuiltinRuntime:
    """The built-in runtime called `name`; UnknownRuntime (a ValueError) names the choices."""
    try:
        return RUNTIMES[name]
    except KeyError:
        raise UnknownRuntime(name) from None
