"""``starlark`` (the catalog's StarlarkRun function), on starlark-pyo3 — a maintained Starlark
implementation (Rust ``starlark``), not a homegrown interpreter.

functionConfig: ``fn.kpt.dev/v1alpha1 StarlarkRun`` with ``source`` (the script) and optional
``params``. The script sees ``ctx.resource_list`` (items, functionConfig, results) and changes it
in place; ``fail(msg)`` ends it with an error result; ``print(...)`` goes to the function's
stderr, as in the catalog's function.
The changes are applied onto the ResourceList node by node, so what the script did not change
keeps its comments and style.
"""

from __future__ import annotations

import json
import re
from typing import Any

import starlark as sl

from runtime_server.krm.resources.resourcelist import (
    ERROR,
    ResourceList,
    Result,
    api_group,
    identity,
    kind,
    update_in_place,
)

PRELUDE = "ctx = struct(resource_list = _resource_list)\n"


def _dialect() -> sl.Dialect:
    dialect = sl.Dialect.extended()
    dialect.enable_top_level_stmt = True  # kpt scripts loop at the top level
    return dialect


def starlark_run(rl: ResourceList) -> None:
    config = rl.function_config
    if not config or kind(config) != "StarlarkRun" or api_group(config) != "fn.kpt.dev":
        rl.add_results([Result("functionConfig must be a fn.kpt.dev/v1alpha1 StarlarkRun", ERROR)])
        return
    source = config.get("source")
    if not isinstance(source, str) or not source.strip():
        rl.add_results([Result("StarlarkRun: `source` (the script) is required", ERROR)])
        return
    name = str((config.get("metadata") or {}).get("name") or "starlark")
    document = json.loads(json.dumps(rl.document, default=str))  # plain values for Starlark
    printed: list[str] = []
    module = sl.Module()
    module["_resource_list"] = document
    module.add_callable("print", lambda *args: printed.append(" ".join(map(str, args))))
    globals_ = sl.Globals.extended_by([sl.LibraryExtension.StructType, sl.LibraryExtension.Json])
    try:
        sl.eval(module, sl.parse(f"{name}.star", PRELUDE + source, _dialect()), globals_)
    except sl.StarlarkError as exc:
        rl.stderr += printed
        rl.add_results([Result(_error_message(str(exc), name), ERROR)])
        return
    rl.stderr += printed
    changed: Any = module["_resource_list"]
    if not isinstance(changed, dict) or not isinstance(changed.get("items"), list):
        rl.add_results([Result(f"starlark {name}: ctx.resource_list lost its items", ERROR)])
        return
    known = {identity(item) for item in rl.items}
    for index, item in enumerate(changed["items"]):
        if identity(item) not in known:  # made by the script: the catalog writes it sorted
            changed["items"][index] = _sorted(item)
    update_in_place(rl.document, changed)


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _sorted(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sorted(element) for element in value]
    return value


def _error_message(text: str, name: str) -> str:
    """A Starlark error as the catalog's function words one: ``fail: why`` for ``fail()``,
    ``NAME:LINE:COL: problem`` for an error at a place in the script."""
    problem = ""
    for line in text.splitlines():
        if line.startswith("error:"):
            problem = line.removeprefix("error:").strip()
            break
    if not problem:
        problem = text.strip().splitlines()[-1] if text.strip() else "failed"
    if problem.startswith("fail:"):
        return problem
    place = re.search(rf"{re.escape(name)}\.star:(\d+):(\d+)", text)
    if place:
        line_number = int(place.group(1)) - PRELUDE.count("\n")  # our prelude is not theirs
        return f"{name}:{line_number}:{place.group(2)}: {problem}"
    return f"{name}: {problem}"
