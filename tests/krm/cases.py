"""Running a builtin KRM function on a ResourceList written in a test, and reading what it made:
the KRM function tests' shared steps."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any

from fnkernel.runtime_server.krm.resources.resourcelist import ResourceList, load

KrmFunction = Callable[[ResourceList], None]


def rl_of(items: str, config: str) -> bytes:
    return (
        "apiVersion: config.kubernetes.io/v1\nkind: ResourceList\nitems:\n"
        + textwrap.indent(textwrap.dedent(items).strip("\n"), "")
        + "\nfunctionConfig:\n"
        + textwrap.indent(textwrap.dedent(config).strip("\n"), "  ")
        + "\n"
    ).encode()


def run(function: KrmFunction, data: bytes) -> ResourceList:
    rl = ResourceList.parse(data)
    function(rl)
    return rl


def run_twice(function: KrmFunction, data: bytes) -> ResourceList:
    """Run, then run again on the output (results dropped): the items must not change again."""
    first = run(function, data)
    again = ResourceList.parse(first.to_bytes())
    again.document.pop("results", None)
    function(again)
    items = lambda rl: load(rl.to_bytes())["items"]  # noqa: E731
    assert items(again) == items(first), "the function is not idempotent"
    return first


def item(rl: ResourceList, kind: str, name: str | None = None) -> Any:
    return next(
        i for i in rl.items if i["kind"] == kind and (name is None or i["metadata"]["name"] == name)
    )
