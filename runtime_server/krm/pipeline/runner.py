"""One step of a pipeline: ``Runner.run`` gives a function its resources (a subset, with
``selectors`` / ``exclude``, merged back after), its config, and its package's paths; runs it
through the chain within the pipeline's bounds; and records the ``Step``."""

from __future__ import annotations

import difflib
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ruamel.yaml.comments import CommentedMap

from fnkernel.runtime_server import tracing
from fnkernel.runtime_server.errors import EvaluatorError, FunctionError, NotFoundError
from fnkernel.runtime_server.krm import chain
from fnkernel.runtime_server.krm.evaluators.base import EvalRequest, Evaluator
from fnkernel.runtime_server.krm.evaluators.builtin import resolve_tag
from fnkernel.runtime_server.krm.functions.processes import Bounds, running
from fnkernel.runtime_server.krm.pipeline.steps import (
    EXEC_NOT_ALLOWED,
    PackageStarted,
    PipelineError,
    PipelineFunction,
    Progress,
    Resource,
    Selector,
    Step,
    qualified,
)
from fnkernel.runtime_server.krm.resources import resourcelist
from fnkernel.runtime_server.krm.resources.package import (
    INDEX_ANNOTATION,
    LEGACY_INDEX_ANNOTATION,
    LEGACY_PATH_ANNOTATION,
    PACKAGE_PATH_ANNOTATION,
    PATH_ANNOTATION,
    Package,
    default_path,
    not_krm,
    render_files,
    source_of,
    strip_internal,
)
from fnkernel.runtime_server.krm.resources.resourcelist import (
    ResourceList,
    annotations_of,
    comment_columns,
    metadata,
    restore_comment_columns,
)

NOT_KRM = "input resource list must contain only KRM resources"
FUNCTION_INPUT = "function-input"


@dataclass
class Runner:
    """Runs steps through `evaluator` (the chain); exec steps only with `allow_exec`. Builtin
    functions run on the parsed resources themselves; other evaluators get them serialized.
    With `diffs`, each step records the unified diff it made (a render of the package before
    and after: the notebook wants it, the terminal does not)."""

    evaluator: Evaluator
    allow_exec: bool = False
    bounds: Bounds = field(default_factory=Bounds)  # each step's time limit and memory
    progress: Progress | None = None
    diffs: bool = True
    steps: list[Step] = field(default_factory=list)
    on_package: PackageStarted | None = None  # told as each package's pipeline starts
    # The pipeline's span, to which each step's is added (docs/protocol.md, "Tracing").
    trace: tracing.Hop | tracing.Untraced = tracing.UNTRACED

    def run(
        self,
        items: list[Resource],
        function: PipelineFunction,
        package: Package | None,
        stage: str,
        config: Resource = None,
    ) -> list[Resource]:
        """Run one step over `items`; the items after it (a validator's are `items` as given).
        A Kptfile's ``exec`` step runs only with `allow_exec` (kpt's ``--allow-exec``)."""
        label = function.label
        step = Step(package.relative if package else "", stage, label, spec=function)
        where = package.display if package else "."
        if function.tag:
            try:
                step.function = label = qualified(resolve_tag(function.image, function.tag))
            except ValueError as exc:
                self._refuse(step, str(exc), items, where)
        if function.command and not self.allow_exec:
            self._refuse(step, EXEC_NOT_ALLOWED, items, where)
        validator = stage == "validator"
        chosen = select(items, function.selectors, function.exclude)
        refused = not_krm_reason(chosen)
        if refused:
            self._refuse(step, refused, items, where)
        if config is None:
            config = function_config(function, package, items)
        before = render_files(items) if self.diffs and not validator else {}
        # A validator works on a copy: whatever it changes is discarded.
        rl = ResourceList.of(
            [resourcelist.deep_copy(i) for i in chosen] if validator else list(chosen), config
        )
        step.inputs = len(chosen)
        started = time.perf_counter()
        prefix = package.relative if package else ""
        before_paths = _enter(rl.items, _package_prefixes(package))
        comments_back = resourcelist.keep_comments(rl.items) if not validator else None
        try:
            with running(self.bounds) as bounded:  # docs/krm.md, "Limits"
                if function.command:
                    log = self._exec(function.command, rl, bounded.deadline)
                    step.evaluator = "exec"
                else:
                    log, step.evaluator, step.skipped = self._evaluate(label, rl, bounded.deadline)
        except EvaluatorError as exc:
            step.duration = time.perf_counter() - started
            step.evaluator, step.skipped = exc.evaluator, exc.skipped
            if isinstance(exc, NotFoundError):
                step.skipped = exc.tried
            _leave(rl.items, prefix, before_paths)  # what _enter changed (a validator's copies)
            step.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            step.exit_code, step.stderr = 1, str(exc)
            if isinstance(exc, FunctionError):
                step.results, step.exit_code, step.stderr = exc.results, exc.exit_code, exc.stderr
            self._record(step)
            message = step.error if label in step.error else f"{label}: {step.error}"
            raise PipelineError(
                message, self.steps, items=items, package=where, handled=True
            ) from None
        step.duration = time.perf_counter() - started
        if comments_back is not None:
            comments_back()
        step.stderr = log.decode("utf-8", "replace")
        step.results = [dict(r) for r in rl.results if isinstance(r, dict)]
        wrong_path = _leave(rl.items, prefix, before_paths)
        if wrong_path:
            self._refuse(step, wrong_path, items, where)
        if validator:
            self._record(step)
            return items
        merged = merge(items, chosen, rl.items)
        if self.diffs:
            step.diff = diff(before, render_files(merged))
        self._record(step)
        return merged

    def _refuse(self, step: Step, why: str, items: list[Resource], package: str) -> NoReturn:
        """The step cannot run: record it as kpt does (an execution error, no result) and stop."""
        step.error = step.execution_error = why
        step.ran = False
        self._record(step)
        raise PipelineError(why, self.steps, items=items, package=package)

    def _evaluate(
        self, image: str, rl: ResourceList, deadline: float
    ) -> tuple[bytes, str, tuple[str, ...]]:
        """Through the chain: (log, the evaluator that served, those that did not have it)."""
        response = self.evaluator.evaluate(EvalRequest(b"", image, parsed=rl), deadline)
        if response.parsed is not rl:
            _take_output(rl, response.resource_list)
        return bytes(response.log), response.evaluator or self.evaluator.name, response.skipped

    def _exec(self, command: str, rl: ResourceList, deadline: float) -> bytes:
        """A Kptfile ``exec`` step, through the evaluator the chain assembles for it."""
        label = f"exec: {command}"
        response = chain.exec_step(command).evaluate(EvalRequest(b"", label, parsed=rl), deadline)
        _take_output(rl, response.resource_list)
        return bytes(response.log)

    def _record(self, step: Step) -> None:
        self.steps.append(step)
        self.trace.ended(step.function, {
            "fnkernel.krm_package": step.package or ".",
            "fnkernel.krm_stage": step.stage,
            "fnkernel.krm_evaluator": step.evaluator,
            "fnkernel.krm_skipped": list(step.skipped),  # the chain's evaluators without it
            "fnkernel.krm_inputs": step.inputs,
            "fnkernel.krm_results": len(step.results),
        }, step.duration, step.error)  # fmt: skip
        if self.progress is not None:
            self.progress(step)


def pipeline_trace(name: str, attributes: dict[str, Any]) -> tracing.Hop | tracing.Untraced:
    """A render's or an eval's span (`name`), in the trace of the ``TRACEPARENT`` in the
    environment (OpenTelemetry's environment carrier) if there is one; exported only."""
    return tracing.recorded("krm", os.environ.get("TRACEPARENT"), name, attributes, kind="INTERNAL")


def not_krm_reason(items: list[Resource]) -> str:
    """kpt's refusal of the first item that is not a KRM object, or ""."""
    for item in items:
        path = source_of(item)[0]
        why = not_krm(item, path)
        if why:
            return f"{NOT_KRM}: {path}: {why}"
    return ""


def _package_prefixes(package: Package | None) -> list[str]:
    """The relative paths of `package` and every package below it, deepest first."""
    if package is None:
        return [""]
    found, queue = [], [package]
    while queue:
        current = queue.pop()
        found.append(current.relative)
        queue += current.subpackages
    return sorted(found, key=len, reverse=True)


def _owner(path: str, prefixes: list[str]) -> str:
    return next((p for p in prefixes if path.startswith(p)), prefixes[-1])


def _enter(items: list[Resource], prefixes: list[str]) -> dict[int, tuple[str, str, str]]:
    """Before a function runs, make each item's path relative to the package it belongs to, as
    kpt gives them until the render ends (docs/krm.md, "Where resources are written"): a
    subpackage's resources reach its parent's functions with the subpackage's own paths.
    Returns each item's (path, index, package prefix), to tell later which annotation the
    function moved and to put the prefix back."""
    before = {}
    for item in items:
        notes = annotations_of(item)
        owner = _owner(
            str(notes.get(PATH_ANNOTATION, notes.get(LEGACY_PATH_ANNOTATION, ""))), prefixes
        )
        for key in (PATH_ANNOTATION, LEGACY_PATH_ANNOTATION):
            if key in notes and owner:
                notes[key] = str(notes[key]).removeprefix(owner)
        if owner != prefixes[-1]:  # what travels through an exec function's output
            notes[PACKAGE_PATH_ANNOTATION] = owner
        before[id(item)] = (
            str(notes.get(PATH_ANNOTATION, "")),
            str(notes.get(INDEX_ANNOTATION, "")),
            owner,
        )
    return before


def _leave(items: list[Resource], prefix: str, before: dict[int, tuple[str, str, str]]) -> str:
    """After a function: reconcile the legacy and internal path/index annotations (the one the
    function changed wins), make paths the top package's again (a resource the function made
    belongs to the package that ran it, `prefix`), and check kpt's rules: a path stays inside
    its package (an absolute one is taken from the package's root) and names one document
    once. Returns what is wrong, or ""."""
    seen: set[tuple[str, str, str]] = set()
    for item in items:
        notes = annotations_of(item)
        if PATH_ANNOTATION not in notes and LEGACY_PATH_ANNOTATION not in notes:
            if prefix:  # a resource a subpackage's function made lives in that subpackage
                notes = metadata(item).setdefault("annotations", CommentedMap())
                notes[PATH_ANNOTATION] = notes[LEGACY_PATH_ANNOTATION] = default_path(item)
            else:
                continue  # it gets a file of its own in the package (render_files)
        old_path, old_index, owner = before.get(id(item), (None, None, prefix))
        owner = str(notes.pop(PACKAGE_PATH_ANNOTATION, owner))
        for internal, legacy, old in (
            (PATH_ANNOTATION, LEGACY_PATH_ANNOTATION, old_path),
            (INDEX_ANNOTATION, LEGACY_INDEX_ANNOTATION, old_index),
        ):
            new, new_legacy = notes.get(internal), notes.get(legacy)
            if new_legacy is not None and (new is None or (new == old and new_legacy != old)):
                notes[internal] = new_legacy
            elif new is not None and new_legacy != new:
                notes[legacy] = new
        path = notes.get(PATH_ANNOTATION)
        if path is None:
            continue
        clean = os.path.normpath(str(path).lstrip("/"))
        if clean == ".." or clean.startswith("../"):
            return (
                f"function must not modify resources outside of package: resource has path {path}"
            )
        key = (owner, clean, str(notes.get(INDEX_ANNOTATION, "0")))
        if key in seen:
            return f'resource at path "{clean}" and index "{key[2]}" already exists'
        seen.add(key)
        notes[PATH_ANNOTATION] = notes[LEGACY_PATH_ANNOTATION] = f"{owner}{clean}"
    return ""


def _take_output(rl: ResourceList, output: bytes) -> None:
    """Make `rl` the ResourceList a function printed, each resource's comments back in their
    columns (they move when nodes are nested one level deeper and serialized)."""
    given = {_source(item): item for item in rl.items}
    columns = {source: comment_columns(item) for source, item in given.items()}
    try:
        out = ResourceList.parse(output)
    except resourcelist.InvalidResourceList as exc:
        raise FunctionError(f"failed to parse function output: {exc}") from None
    for item in out.items:
        source = _source(item)
        restore_comment_columns(item, columns.get(source, {}))
        if source in given:  # what the function dropped comes back, as in kpt
            resourcelist.copy_missing_comments(given[source], item)
    rl.document = out.document


def _source(item: Resource) -> tuple[str, str, int]:
    """Which package, file and document a resource is from, while a function has it."""
    return (str(annotations_of(item).get(PACKAGE_PATH_ANNOTATION, "")), *source_of(item))


def matches(resource: Resource, selector: Selector) -> bool:
    meta = resource.get("metadata") or {}
    for key, value in (
        ("apiVersion", resource.get("apiVersion")),
        ("kind", resource.get("kind")),
        ("name", meta.get("name")),
        ("namespace", meta.get("namespace")),
    ):
        if selector.get(key) and selector[key] != value:
            return False
    for key in ("labels", "annotations"):
        wanted = selector.get(key) or {}
        have = meta.get(key) or {}
        if any(have.get(k) != v for k, v in wanted.items()):
            return False
    return True


def select(
    items: list[Resource], selectors: Sequence[Selector], exclude: Sequence[Selector]
) -> list[Resource]:
    """The items a function runs on: those matching any selector (all if none), minus those
    matching any exclude."""
    chosen = [i for i in items if not selectors or any(matches(i, s) for s in selectors)]
    return [i for i in chosen if not any(matches(i, e) for e in exclude)]


def merge(items: list[Resource], chosen: list[Resource], output: list[Resource]) -> list[Resource]:
    """`items` with the `chosen` subset replaced by the function's `output`, in its place."""
    chosen_ids = {id(item) for item in chosen}
    merged: list[Resource] = []
    inserted = False
    for item in items:
        if id(item) in chosen_ids:
            if not inserted:
                merged.extend(output)
                inserted = True
            continue
        merged.append(item)
    if not inserted:
        merged.extend(output)
    return merged


def config_map(data: Mapping[str, object]) -> Resource:
    """The ConfigMap kpt gives a function configured by ``configMap`` (or ``-- key=value``)."""
    return CommentedMap(
        apiVersion="v1",
        kind="ConfigMap",
        metadata=CommentedMap(
            name=FUNCTION_INPUT,
            annotations=CommentedMap({"config.kubernetes.io/local-config": "true"}),
        ),
        data=CommentedMap((str(k), str(v)) for k, v in data.items()),
    )


def function_config(
    function: PipelineFunction, package: Package | None, items: list[Resource]
) -> Resource:
    """The function's config: its configMap, the package's resource at its configPath, or
    None."""
    if function.config_map is not None:
        return config_map(function.config_map)
    if function.config_path:
        wanted = f"{package.relative if package else ''}{function.config_path}"
        for item in items:
            if source_of(item)[0] == wanted:
                config = resourcelist.deep_copy(item)
                strip_internal(config)
                return config
        raise PipelineError(
            f"configPath {function.config_path} is not a resource of the package", []
        )
    return None


def diff(before: Mapping[str, str], after: Mapping[str, str]) -> str:
    chunks: list[str] = []
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path, ""), after.get(path, "")
        if old != new:
            chunks += difflib.unified_diff(
                old.splitlines(keepends=True),
                new.splitlines(keepends=True),
                f"a/{path}" if path in before else "/dev/null",
                f"b/{path}" if path in after else "/dev/null",
            )
    return "".join(chunks)
