"""``starlark`` (the catalog's StarlarkRun function), on starlark-pyo3 — a maintained Starlark
implementation (Rust ``starlark``), not a homegrown interpreter.

functionConfig: ``fn.kpt.dev/v1alpha1 StarlarkRun`` with ``source`` (the script) and optional
``params``. The script sees ``ctx.resource_list`` (items, functionConfig, results) and changes it
in place; ``fail(msg)`` ends it with an error result; ``print(...)`` goes to the function's
stderr, as in the catalog's function.
The script runs in a process of its own (``_starlark_worker.py``), within the pipeline step's
time limit and memory bound (docs/krm.md, "Limits"): it is the user's code, and one that loops
for ever or builds a list of two billion items is stopped with a message naming the bound, not
left to take the render — or the kernel — with it.
The changes are applied onto the ResourceList node by node, so what the script did not change
keeps its comments and style.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from fnkernel.runtime_server.errors import DeadlineExceeded
from fnkernel.runtime_server.krm.functions.processes import (
    current,
    memory_message,
    out_of_memory,
    run_function,
)
from fnkernel.runtime_server.krm.resources.resourcelist import (
    ERROR,
    ResourceList,
    Result,
    api_group,
    block_style,
    kind,
    update_in_place,
)

WORKER = Path(__file__).with_name("_starlark_worker.py")
PRELUDE = "ctx = struct(resource_list = _resource_list)\n"  # before the script, in the worker
DEFAULT_NAME = "starlark-function-run"


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


def starlark_run(rl: ResourceList) -> None:
    try:
        name, source = read_config(rl.function_config)
    except ValueError as exc:
        rl.add_results([Result(str(exc), ERROR)])
        return
    document = json.loads(json.dumps(rl.document, default=str))  # plain values for Starlark
    script = {"name": name, "source": PRELUDE + source, "resource_list": document}
    request = json.dumps(script).encode()
    try:
        code, stdout, stderr = run_function([sys.executable, "-P", str(WORKER)], request, None)
    except DeadlineExceeded:
        raise DeadlineExceeded(
            f"starlark {name}: the script did not finish within the step's time limit of "
            f"{current().bounds.timeout:g} s (--timeout); it was stopped"
        ) from None
    lines = [json.loads(line) for line in _whole_lines(stdout)]
    rl.stderr += [line["printed"] for line in lines if "printed" in line]  # also if it was stopped
    if code != 0:
        why = memory_message("the script") if out_of_memory(code, stderr) else _crash(code, stderr)
        rl.add_results([Result(f"starlark {name}: {why}", ERROR)])
        return
    answer = lines[-1]
    if answer["error"] is not None:
        rl.add_results([Result(_error_message(answer["error"], name), ERROR)])
        return
    changed: Any = answer["resource_list"]
    if not isinstance(changed, dict) or not isinstance(changed.get("items"), list):
        rl.add_results([Result(f"starlark {name}: ctx.resource_list lost its items", ERROR)])
        return
    # What the script made is written as the catalog's function writes it: keys sorted.
    update_in_place(rl.document, changed, made=lambda value: block_style(_sorted(value)))


def _whole_lines(stdout: bytes) -> list[bytes]:
    """The worker's JSON lines, but one it was stopped in the middle of."""
    lines = stdout.split(b"\n")
    return [line for line in lines[:-1] if line]


def _crash(code: int, stderr: bytes) -> str:
    last = stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit status {code}"]
    return f"the interpreter ended ({last[0][:200]})"


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
