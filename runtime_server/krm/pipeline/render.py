"""kpt's renders (depth first, or breadth first with ``kpt.dev/bfs-rendering``) and
``fn eval``: which package's pipeline runs when, over which resources, and what is written
after."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fnkernel.runtime_server import tracing
from fnkernel.runtime_server.krm.evaluators.base import Evaluator
from fnkernel.runtime_server.krm.functions.processes import Bounds
from fnkernel.runtime_server.krm.pipeline.records import status_text, write_results
from fnkernel.runtime_server.krm.pipeline.runner import (
    Runner,
    config_map,
    not_krm_reason,
    pipeline_trace,
)
from fnkernel.runtime_server.krm.pipeline.steps import (
    Outcome,
    PackageStarted,
    PipelineError,
    PipelineFunction,
    Progress,
    Resource,
    Step,
)
from fnkernel.runtime_server.krm.pipeline.writer import stage, write_package
from fnkernel.runtime_server.krm.resources import kptfile
from fnkernel.runtime_server.krm.resources.package import (
    KPTFILE,
    Package,
    PackageError,
    check_config_paths,
    load_package,
    read_kptfile,
    render_files,
    source_of,
)
from fnkernel.runtime_server.krm.resources.resourcelist import kind


def outcome_of(steps: list[Step], before: dict[str, str], items: list[Resource]) -> Outcome:
    identities = []
    for item in items:
        meta = item.get("metadata") or {}
        identities.append((kind(item), str(meta.get("namespace", "")), str(meta.get("name", ""))))
    return Outcome(steps, before, render_files(items, tidy=True), identities, items=items)


def _render(package: Package, runner: Runner) -> list[Resource]:
    """kpt's depth-first render of `package`: its subpackages, then its own pipeline over its
    resources, its Kptfile and the subpackages' output. A PipelineError carries the items made
    so far (``items``), in the order kpt would save them."""
    items = package.local_resources()
    for sub in package.subpackages:
        try:
            items += _render(sub, runner)
        except PipelineError as exc:
            exc.items = items + (exc.items or [])
            raise
    return _run_pipeline(package, items, runner)


def _render_breadth_first(top: Package, runner: Runner) -> list[Resource]:
    """kpt's breadth-first render (``kpt.dev/bfs-rendering``): each package's pipeline runs
    before its subpackages', over its resources and all its descendants' as they are then; the
    output goes back to the package each resource belongs to."""
    order, queue = [], [top]
    while queue:
        package = queue.pop(0)
        order.append(package)
        queue += package.subpackages
    owned = {package.relative: package.local_resources() for package in order}

    def descendants(package: Package) -> list[Resource]:
        found = []
        for sub in package.subpackages:
            found += owned[sub.relative] + descendants(sub)
        return found

    def give_back(package: Package, output: list[Resource]) -> None:
        mine = {package.relative, *(p.relative for p in _all_below(package))}
        for relative in mine:
            owned[relative] = []
        for item in output:
            path = source_of(item)[0]
            owner = max(
                (r for r in mine if r and path.startswith(r)), key=len, default=package.relative
            )
            owned[owner].append(item)

    for package in order:
        items = owned[package.relative] + descendants(package)
        try:
            output = _run_pipeline(package, items, runner)
        except PipelineError as exc:
            give_back(package, exc.items if exc.items is not None else items)
            exc.items = [item for p in order for item in owned[p.relative]]
            if package is not top:  # kpt reports it under the top package's pipeline
                exc.breadth_first_in = package.display
            exc.package = top.display
            exc.in_step = True
            raise
        give_back(package, output)
    return [item for package in order for item in owned[package.relative]]


def _all_below(package: Package) -> list[Package]:
    found = []
    for sub in package.subpackages:
        found += [sub, *_all_below(sub)]
    return found


def _run_pipeline(package: Package, items: list[Resource], runner: Runner) -> list[Resource]:
    """One package's own pipeline over `items`: mutators in order, then validators."""
    if runner.on_package is not None:
        runner.on_package(package)
    try:
        check_config_paths(package)
    except PackageError as exc:
        raise PipelineError(
            str(exc), runner.steps, items=items, package=package.display, in_step=False
        ) from None
    pipeline = package.pipeline
    mutators, validators = pipeline.get("mutators") or [], pipeline.get("validators") or []
    if not mutators and not validators:
        refused = not_krm_reason(items)
        if refused:
            raise PipelineError(
                refused,
                runner.steps,
                items=items,
                package=package.display,
                in_step=False,
            )
        return items
    for spec in mutators:
        items = runner.run(items, _function(spec, runner, items), package, "mutator")
    for spec in validators:
        runner.run(items, _function(spec, runner, items), package, "validator")
    return items


def _function(spec: Mapping[str, Any], runner: Runner, items: list[Resource]) -> PipelineFunction:
    """A Kptfile's pipeline entry as the PipelineFunction it names, when its turn comes."""
    try:
        return PipelineFunction.of(spec)
    except PipelineError as exc:
        raise PipelineError(str(exc), runner.steps, items=items) from None


def _flag(document: Resource, annotation: str) -> bool:
    notes = (document.get("metadata") or {}).get("annotations") or {}
    return str(notes.get(annotation, "")).lower() == "true"


def _top_kptfile(items: list[Resource]) -> Resource:
    for item in items:
        if source_of(item) == (KPTFILE, 0) and kind(item) == KPTFILE:
            return item
    return None


def render(
    root: Path,
    evaluator: Evaluator,
    *,
    allow_exec: bool = False,
    dry_run: bool = False,
    results_dir: Path | None = None,
    progress: Progress | None = None,
    diffs: bool = True,
    on_package: PackageStarted | None = None,
    in_place: bool = True,
    bounds: Bounds | None = None,
) -> Outcome:
    """Render the package at `root` in place (unless `dry_run`). On a failure, raises
    PipelineError having written the results and the Kptfile's status, and, when the Kptfile
    asks for it (``kpt.dev/save-on-render-failure``), what the pipeline made before it failed.
    `diffs`: record each step's diff. Not `in_place`: the output goes elsewhere (``-o``), so
    the package is not touched and its Kptfile gets no status."""
    try:
        package = load_package(root)
    except PackageError as exc:
        if in_place and not dry_run:
            _record_unreadable_subpackage(root, exc)
        raise
    runner = Runner(
        evaluator,
        allow_exec=allow_exec,
        bounds=bounds or Bounds(),
        progress=progress,
        diffs=diffs,
        on_package=on_package,
        trace=pipeline_trace("fn render", {"fnkernel.krm_package": str(root)}),
    )
    before = package.all_texts()
    failure: PipelineError | None = None
    breadth_first = _flag(package.kptfile, kptfile.BFS_RENDER)
    try:
        with tracing.finishing(runner.trace):
            items = (_render_breadth_first if breadth_first else _render)(package, runner)
    except PipelineError as exc:
        failure = exc
        items = exc.items or []
    finally:
        if results_dir is not None:
            write_results(results_dir, runner.steps)
    save = failure is None or _flag(package.kptfile, kptfile.SAVE_ON_FAILURE)
    outcome = outcome_of(runner.steps, before, items if save else [])
    if not in_place:
        if failure is not None:
            raise failure
        return outcome
    top = _top_kptfile(items) if save else None  # else the Kptfile as it is on disk
    outcome.after[KPTFILE] = status_text(
        top if top is not None else package.kptfile, runner.steps, failure
    )
    write_package(root, outcome, prune=failure is None, dry_run=dry_run)
    if failure is not None:
        failure.steps = runner.steps
        failure.saved = save
        raise failure
    return outcome


def _record_unreadable_subpackage(root: Path, error: PackageError) -> None:
    """A subpackage's Kptfile that cannot be read fails the render before any step; kpt records
    that in the top Kptfile's status, when the top one can be read (docs/krm.md, "Failures")."""
    if not error.kptfile_of.startswith("./"):  # the top package's own Kptfile, or no Kptfile
        return
    try:
        top, _ = read_kptfile(root, ".")
    except PackageError:
        return
    failure = PipelineError(
        f'pkg {error.kptfile_of}: error reading Kptfile at "{error.kptfile_of}": {error.reason}',
        [],
    )
    failure.render_stage = "pkg.Subpackages"
    target = root / KPTFILE
    os.replace(stage(target, status_text(top, [], failure)), target)


def evaluate_one(
    root: Path | None,
    function: PipelineFunction,
    evaluator: Evaluator,
    *,
    config: Resource = None,
    data: Mapping[str, str] | None = None,
    dry_run: bool = False,
    progress: Progress | None = None,
    include_meta: bool = False,
    items: list[Resource] | None = None,
    results_dir: Path | None = None,
    config_file: Path | None = None,
    bounds: Bounds | None = None,
) -> Outcome:
    """``kpt fn eval``: one `function` (an image or an exec command, with its selectors and
    excludes) over the resources under `root` (with `include_meta`, the
    Kptfiles too), or over `items` (a ResourceList's, ``root`` None: nothing is written).
    Configured by `config` (a KRM object, ``--fn-config``) or by `data` (``-- key=value``: a
    ConfigMap)."""
    before: dict[str, str] = {}
    if root is not None:
        package = load_package(root, require_kptfile=False)
        items = package.all_resources(meta=include_meta)
        before = package.all_texts()
        if not include_meta:  # the Kptfiles are not the function's to keep or remove
            for each in (package, *_all_below(package)):
                before.pop(f"{each.relative}{KPTFILE}", None)
        if config_file is not None and config_file.resolve().is_relative_to(root.resolve()):
            # the function's own config, kept in the package, is not among its input (kpt)
            own = os.path.relpath(config_file.resolve(), root.resolve())
            items = [item for item in items if source_of(item)[0] != own]
            before.pop(own, None)  # nor is its file the function's to keep or remove
    items = list(items or [])
    if config is None and data:
        config = config_map(data)
    runner = Runner(
        evaluator,
        allow_exec=True,
        bounds=bounds or Bounds(),
        progress=progress,
        trace=pipeline_trace("fn eval", {"fnkernel.krm_function": function.label}),
    )
    try:
        with tracing.finishing(runner.trace):
            items = runner.run(items, function, None, "eval", config=config)
    finally:
        if results_dir is not None:
            write_results(results_dir, runner.steps)
    outcome = outcome_of(runner.steps, before, items)
    if root is not None:
        write_package(root, outcome, prune=True, dry_run=dry_run)
    return outcome
