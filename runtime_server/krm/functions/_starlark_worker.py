"""Runs one starlark script for the ``starlark`` function, in a process of its own (docs/krm.md,
"Limits"): the script is the user's, and a loop that never ends or a list of two billion items
must be stopped without taking the render — or the kernel it runs in — with it.

Run as ``python -P _starlark_worker.py`` (standard library and starlark-pyo3 only, so that it
starts in tens of milliseconds). Reads one JSON object from stdin — ``name``, ``source`` (with
the function's prelude, which binds ``ctx``), ``resource_list`` (plain JSON values) — and writes
JSON lines to stdout: ``{"printed": TEXT}`` for each ``print()`` as it is called (so what a
script printed survives it being stopped), then ``resource_list`` as the script left it and
``error`` (Starlark's own text, or null). The
memory bound is set on this process by whoever starts it; exceeding it ends the process (Rust
aborts when an allocation fails), which its parent reports.
"""

from __future__ import annotations

import json
import sys

import starlark as sl

# Modules a script may load(), as the catalog's function offers them; only JSON is here.
LOADABLE = {"encoding/json.star": "json"}


def _dialect() -> sl.Dialect:
    dialect = sl.Dialect.extended()
    dialect.enable_top_level_stmt = True  # kpt scripts loop at the top level
    return dialect


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


def _print(*args: object) -> None:
    sys.stdout.write(json.dumps({"printed": " ".join(map(str, args))}) + "\n")
    sys.stdout.flush()


def run(name: str, source: str, resource_list: object) -> dict[str, object]:
    module = sl.Module()
    module["_resource_list"] = resource_list
    module.add_callable("print", _print)
    globals_ = sl.Globals.extended_by([sl.LibraryExtension.StructType, sl.LibraryExtension.Json])
    try:
        sl.eval(module, sl.parse(f"{name}.star", source, _dialect()), globals_, _LOADER)
    except sl.StarlarkError as exc:
        return {"resource_list": None, "error": str(exc)}
    return {"resource_list": module["_resource_list"], "error": None}


def main() -> None:
    request = json.load(sys.stdin)
    answer = run(request["name"], request["source"], request["resource_list"])
    sys.stdout.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
