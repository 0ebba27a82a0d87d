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
    block_style,
    kind,
    update_in_place,
)

PRELUDE = "ctx = struct(resource_list = _resource_list)\n"


def _dialect() -> sl.Dialect:
    dialect = sl.Dialect.extended()
    dialect.enable_top_level_stmt = True  # kpt scripts loop at the top level
    return dialect


DEFAULT_NAME = "starlark-function-run"
# Modules a script may load(), as the catalog's function offers them; only JSON is here.
LOADABLE = {"encoding/json.star": "json"}


def read_config(config: Any) -> tuple[str, str]:
    """(script name, source) from a ``StarlarkRun`` or a ConfigMap (``data.source``)."""
    if not config:
        raise ValueError("FunctionConfig is missing. Expect `ConfigMap` or `StarlarkRun`")
    if kind(config) == "ConfigMap" and api_group(config) == "":
        source = (config.get("data") or {}).get("source")
    elif kind(config) == "StarlarkRun" and api_group(config) == "fn.kpt.dev":
        source = config.get("source")
    else:
        found = f"{config.get('apiVersion')}, Kind={kind(config)}"
        raise ValueError(
            "`functionConfig` must be either /v1, Kind=ConfigMap or "
            f"fn.kpt.dev/v1alpha1, Kind=StarlarkRun, but we got: {found}"
        )
    name = str((config.get("metadata") or {}).get("name") or DEFAULT_NAME)
    if not isinstance(source, str) or not source:
        raise ValueError("`source` must not be empty")
    return name, source


def _loader(name: str) -> sl.FrozenModule:
    """``load()``: the modules in LOADABLE, each a builtin of starlark-pyo3 under its name."""
    module = sl.Module()
    if name == "builtin.star":  # a builtin can only leave its scope through a function
        globals_ = sl.Globals.extended_by([sl.LibraryExtension.Json])
        source = "def _get():\n  return json\nbuiltin_json = _get()\n"
        sl.eval(module, sl.parse(name, source, _dialect()), globals_)
    elif name in LOADABLE:
        source = f"load('builtin.star', 'builtin_json')\n{LOADABLE[name]} = builtin_json\n"
        sl.eval(module, sl.parse(name, source, _dialect()), sl.Globals.standard(), _LOADER)
    else:
        raise FileNotFoundError(f"cannot load {name}: only {', '.join(LOADABLE)} can be loaded")
    return module.freeze()


_LOADER = sl.FileLoader(_loader)


def starlark_run(rl: ResourceList) -> None:
    try:
        name, source = read_config(rl.function_config)
    except ValueError as exc:
        rl.add_results([Result(str(exc), ERROR)])
        return
    document = json.loads(json.dumps(rl.document, default=str))  # plain values for Starlark
    printed: list[str] = []
    module = sl.Module()
    module["_resource_list"] = document
    module.add_callable("print", lambda *args: printed.append(" ".join(map(str, args))))
    globals_ = sl.Globals.extended_by([sl.LibraryExtension.StructType, sl.LibraryExtension.Json])
    try:
        sl.eval(module, sl.parse(f"{name}.star", PRELUDE + source, _dialect()), globals_, _LOADER)
    except sl.StarlarkError as exc:
        rl.stderr += printed
        rl.add_results([Result(_error_message(str(exc), name), ERROR)])
        return
    rl.stderr += printed
    changed: Any = module["_resource_list"]
    if not isinstance(changed, dict) or not isinstance(changed.get("items"), list):
        rl.add_results([Result(f"starlark {name}: ctx.resource_list lost its items", ERROR)])
        return
    # What the script made is written as the catalog's function writes it: keys sorted.
    update_in_place(rl.document, changed, made=lambda value: block_style(_sorted(value)))


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
