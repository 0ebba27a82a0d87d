"""``kpt fn render`` / ``kpt fn eval`` semantics over the evaluator chain (docs/krm.md).

Subpackages render first; then the package's mutators run in order over its resources, its
Kptfile and its subpackages'; then its validators, each on a copy whose output is discarded.
``configMap`` becomes a ConfigMap named ``function-input``; a short image name gets the catalog
prefix; an ``exec`` step needs ``allow_exec``; ``selectors``/``exclude`` run a function on a
subset and merge the result back. After a render the top Kptfile records it (``status``). A
failure writes nothing but that status, unless the Kptfile asks to keep what succeeded
(``kpt.dev/save-on-render-failure``). Each step records the function, the evaluator that served
it, its duration, its results and the unified diff it made.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import shlex
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from ruamel.yaml.comments import CommentedMap, CommentedSeq

from runtime_server.errors import EvaluatorError, FunctionError, NotFoundError
from runtime_server.krm.evaluators.base import EvalRequest, Evaluator
from runtime_server.krm.evaluators.wrapper import WrapperEvaluator
from runtime_server.krm.functions.processes import Bounds, running
from runtime_server.krm.resources import kptfile, resourcelist
from runtime_server.krm.resources.package import (
    INDEX_ANNOTATION,
    KPTFILE,
    LEGACY_INDEX_ANNOTATION,
    LEGACY_PATH_ANNOTATION,
    PATH_ANNOTATION,
    Package,
    PackageError,
    check_config_paths,
    default_path,
    dump_text,
    load_package,
    not_krm,
    read_resources,
    render_files,
    source_of,
    strip_internal,
)
from runtime_server.krm.resources.resourcelist import (
    ResourceList,
    annotations_of,
    comment_columns,
    kind,
    metadata,
    restore_comment_columns,
)

CATALOG = "ghcr.io/kptdev/krm-functions-catalog/"
EXEC_NOT_ALLOWED = "must run with `--allow-exec` option to allow running function binaries"
NOT_KRM = "input resource list must contain only KRM resources"
FUNCTION_INPUT = "function-input"
RESULT_LIST = {"apiVersion": "kpt.dev/v1", "kind": "FunctionResultList"}


def qualified(image: str) -> str:
    """A short image name gets the catalog prefix (kpt's rule); a full one is kept."""
    return image if "/" in image or image.startswith("fn://") else CATALOG + image


@dataclass
class Step:
    """One function run of a pipeline, as the terminal and the notebook show it."""

    package: str  # relative to the top package, "" for the top
    stage: str  # "mutator" | "validator" | "eval"
    function: str  # the image, or "exec: ARGV"
    evaluator: str = ""
    skipped: tuple[str, ...] = ()  # the chain's evaluators that did not have the function
    duration: float = 0.0
    results: list[dict[str, Any]] = field(default_factory=list)
    diff: str = ""
    exit_code: int = 0
    stderr: str = ""
    error: str = ""
    # Set when the step could not run at all (kpt's "executionError"), rather than ran and failed.
    execution_error: str = ""
    spec: Mapping[str, Any] = field(default_factory=dict)  # the Kptfile's step, for the status
    ran: bool = True  # false for a step refused before running (it gets no results entry)
    inputs: int = 0  # how many resources it was given

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def name(self) -> str:
        """How kpt names the function: its image, or the exec command."""
        return self.function.removeprefix("exec: ")

    def reference(self) -> dict[str, str]:
        """``{"image": IMAGE}`` or ``{"exec": COMMAND}``, as kpt's records name a function."""
        return {"exec" if self.function.startswith("exec: ") else "image": self.name}

    def status(self) -> dict[str, Any]:
        """The step as kpt records it in the Kptfile's ``status.renderStatus``."""
        entry: dict[str, Any] = {"name": self.spec.get("name", ""), **self.reference()}
        if self.execution_error:
            entry.update(executionError=self.execution_error, exitCode=1)
            return entry
        errors = [r for r in self.results if r.get("severity") == resourcelist.ERROR]
        entry.update(
            stderr=self.stderr,
            exitCode=self.exit_code if not self.ok else 0,
            results=self.results,
            errorResults=errors,
        )
        return entry


class PipelineError(Exception):
    """A step (or the package) failed. ``steps`` holds every step run, the failed one last;
    ``items`` what the pipeline had made when it stopped (kept with save-on-render-failure);
    ``package`` the package that failed, as kpt names it ("." or "./sub"); ``in_step`` whether
    it failed running its pipeline (kpt reports those one level deeper)."""

    def __init__(
        self,
        message: str,
        steps: list[Step],
        *,
        items: list[Any] | None = None,
        package: str = ".",
        in_step: bool = True,
        handled: bool = False,
    ) -> None:
        super().__init__(message)
        self.steps = steps
        self.items = items
        self.package = package
        self.in_step = in_step
        self.handled = handled  # a function failure: its output already says why
        self.breadth_first_in = ""  # the subpackage a breadth-first render failed in
        self.saved = False  # what succeeded was written (kpt.dev/save-on-render-failure)

    def condition(self) -> str:
        """The message kpt writes in the Kptfile's ``Rendered`` condition."""
        why = "already handled error" if self.handled else str(self)
        if self.breadth_first_in:
            why = f"pkg {self.breadth_first_in}: {why}"
        if self.in_step:
            return f"pkg.render: pkg {self.package}:\n\tpipeline.run: {why}"
        return f"pkg.render: pkg {self.package}: {why}"


@dataclass
class Outcome:
    steps: list[Step]
    before: dict[str, str]  # relative path → text
    after: dict[str, str]
    resources: list[tuple[str, str, str]]  # (kind, namespace, name) of every output resource
    written: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    items: list[Any] = field(default_factory=list)  # the output resources, annotated


def outcome_of(steps: list[Step], before: dict[str, str], items: list[Any]) -> Outcome:
    identities = []
    for item in items:
        meta = item.get("metadata") or {}
        identities.append((kind(item), str(meta.get("namespace", "")), str(meta.get("name", ""))))
    return Outcome(steps, before, render_files(items), identities, items=items)


Progress = Callable[[Step], None]
PackageStarted = Callable[[Package], None]


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

    def run(
        self,
        items: list[Any],
        spec: Mapping[str, Any],
        package: Package | None,
        stage: str,
        config: Any = None,
    ) -> list[Any]:
        """Run one step over `items`; the items after it (a validator's are `items` as given)."""
        image = str(spec.get("image", "") or "")
        exec_command = str(spec.get("exec", "") or "")
        if bool(image) == bool(exec_command):
            raise PipelineError(
                f"a pipeline function needs exactly one of image or exec, got {dict(spec)}",
                self.steps,
            )
        label = qualified(image) if image else f"exec: {exec_command}"
        step = Step(package.relative if package else "", stage, label, spec=spec)
        where = package.display if package else "."
        if exec_command and not self.allow_exec:
            self._refuse(step, EXEC_NOT_ALLOWED, items, where)
        validator = stage == "validator"
        chosen = select(items, spec.get("selectors") or [], spec.get("exclude") or [])
        refused = _not_krm_reason(chosen)
        if refused:
            self._refuse(step, refused, items, where)
        if config is None:
            config = function_config(spec, package, items)
        before = render_files(items) if self.diffs and not validator else {}
        # A validator works on a copy: whatever it changes is discarded.
        rl = ResourceList.of(
            [resourcelist.deep_copy(i) for i in chosen] if validator else list(chosen), config
        )
        step.inputs = len(chosen)
        started = time.perf_counter()
        prefix = package.relative if package else ""
        before_paths = _enter(rl.items, prefix)
        try:
            with running(self.bounds) as bounded:  # docs/krm.md, "Limits"
                if exec_command:
                    log = self._exec(exec_command, rl, package, bounded.deadline)
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

    def _refuse(self, step: Step, why: str, items: list[Any], package: str) -> NoReturn:
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

    def _exec(
        self, command: str, rl: ResourceList, package: Package | None, deadline: float
    ) -> bytes:
        """A Kptfile ``exec`` step: the command, run as a function pod's entrypoint is."""
        argv = shlex.split(command)  # a relative path is the current directory's, as in kpt
        label = f"exec: {command}"
        response = WrapperEvaluator(argv, label).evaluate(
            EvalRequest(b"", label, parsed=rl), deadline
        )
        _take_output(rl, response.resource_list)
        return bytes(response.log)

    def _record(self, step: Step) -> None:
        self.steps.append(step)
        if self.progress is not None:
            self.progress(step)


def _not_krm_reason(items: list[Any]) -> str:
    """kpt's refusal of the first item that is not a KRM object, or ""."""
    for item in items:
        path = source_of(item)[0]
        why = not_krm(item, path)
        if why:
            return f"{NOT_KRM}: {path}: {why}"
    return ""


def _enter(items: list[Any], prefix: str) -> dict[int, tuple[str, str]]:
    """Before a subpackage's function runs, make the items' paths its package's, as kpt gives
    them; returns each item's (path, index) to tell later which annotation the function moved."""
    before = {}
    for item in items:
        notes = annotations_of(item)
        for key in (PATH_ANNOTATION, LEGACY_PATH_ANNOTATION):
            if key in notes and prefix:
                notes[key] = str(notes[key]).removeprefix(prefix)
        before[id(item)] = (
            str(notes.get(PATH_ANNOTATION, "")),
            str(notes.get(INDEX_ANNOTATION, "")),
        )
    return before


def _leave(items: list[Any], prefix: str, before: dict[int, tuple[str, str]]) -> str:
    """After a function: reconcile the legacy and internal path/index annotations (the one the
    function changed wins), make paths the top package's again, and check kpt's rules: a path
    stays inside the package (an absolute one is taken from the package's root) and names one
    document once. Returns what is wrong, or ""."""
    seen: set[tuple[str, str]] = set()
    for item in items:
        notes = annotations_of(item)
        if PATH_ANNOTATION not in notes and LEGACY_PATH_ANNOTATION not in notes:
            if prefix:  # a resource a subpackage's function made lives in that subpackage
                notes = metadata(item).setdefault("annotations", CommentedMap())
                notes[PATH_ANNOTATION] = notes[LEGACY_PATH_ANNOTATION] = default_path(item)
            else:
                continue  # it gets a file of its own in the package (render_files)
        old_path, old_index = before.get(id(item), (None, None))
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
        key = (clean, str(notes.get(INDEX_ANNOTATION, "0")))
        if key in seen:
            return f'resource at path "{clean}" and index "{key[1]}" already exists'
        seen.add(key)
        notes[PATH_ANNOTATION] = notes[LEGACY_PATH_ANNOTATION] = f"{prefix}{clean}"
    return ""


def _take_output(rl: ResourceList, output: bytes) -> None:
    """Make `rl` the ResourceList a function printed, each resource's comments back in their
    columns (they move when nodes are nested one level deeper and serialized)."""
    columns = {source_of(item): comment_columns(item) for item in rl.items}
    try:
        out = ResourceList.parse(output)
    except resourcelist.InvalidResourceList as exc:
        raise FunctionError(f"failed to parse function output: {exc}") from None
    for item in out.items:
        restore_comment_columns(item, columns.get(source_of(item), {}))
    rl.document = out.document


def matches(resource: Any, selector: Mapping[str, Any]) -> bool:
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


def select(items: list[Any], selectors: Sequence[Any], exclude: Sequence[Any]) -> list[Any]:
    """The items a function runs on: those matching any selector (all if none), minus those
    matching any exclude."""
    chosen = [i for i in items if not selectors or any(matches(i, s) for s in selectors)]
    return [i for i in chosen if not any(matches(i, e) for e in exclude)]


def merge(items: list[Any], chosen: list[Any], output: list[Any]) -> list[Any]:
    """`items` with the `chosen` subset replaced by the function's `output`, in its place."""
    chosen_ids = {id(item) for item in chosen}
    merged: list[Any] = []
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


def function_config(spec: Mapping[str, Any], package: Package | None, items: list[Any]) -> Any:
    if spec.get("configMap") is not None:
        data = spec["configMap"]
        if not isinstance(data, Mapping):
            raise PipelineError("configMap must be a map of strings", [])
        return CommentedMap(
            apiVersion="v1",
            kind="ConfigMap",
            metadata=CommentedMap(
                name=FUNCTION_INPUT,
                annotations=CommentedMap({"config.kubernetes.io/local-config": "true"}),
            ),
            data=CommentedMap((str(k), str(v)) for k, v in data.items()),
        )
    if spec.get("configPath"):
        wanted = f"{package.relative if package else ''}{spec['configPath']}"
        for item in items:
            if source_of(item)[0] == wanted:
                config = resourcelist.deep_copy(item)
                strip_internal(config)
                return config
        raise PipelineError(f"configPath {spec['configPath']} is not a resource of the package", [])
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


def _render(package: Package, runner: Runner) -> list[Any]:
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


def _render_breadth_first(top: Package, runner: Runner) -> list[Any]:
    """kpt's breadth-first render (``kpt.dev/bfs-rendering``): each package's pipeline runs
    before its subpackages', over its resources and all its descendants' as they are then; the
    output goes back to the package each resource belongs to."""
    order, queue = [], [top]
    while queue:
        package = queue.pop(0)
        order.append(package)
        queue += package.subpackages
    owned = {package.relative: package.local_resources() for package in order}

    def descendants(package: Package) -> list[Any]:
        found = []
        for sub in package.subpackages:
            found += owned[sub.relative] + descendants(sub)
        return found

    def give_back(package: Package, output: list[Any]) -> None:
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


def _run_pipeline(package: Package, items: list[Any], runner: Runner) -> list[Any]:
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
        refused = _not_krm_reason(items)
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
        items = runner.run(items, spec, package, "mutator")
    for spec in validators:
        runner.run(items, spec, package, "validator")
    return items


def _flag(document: Any, annotation: str) -> bool:
    notes = (document.get("metadata") or {}).get("annotations") or {}
    return str(notes.get(annotation, "")).lower() == "true"


def _top_kptfile(items: list[Any]) -> Any:
    for item in items:
        if source_of(item) == (KPTFILE, 0) and kind(item) == KPTFILE:
            return item
    return None


def status_text(kptfile_node: Any, steps: list[Step], error: PipelineError | None) -> str:
    """The top Kptfile as kpt writes it after a render: its ``Rendered`` condition and the status
    of every step (docs/krm.md, "The Kptfile")."""
    document = resourcelist.deep_copy(kptfile_node)
    strip_internal(document)
    mutation = [s.status() for s in steps if s.stage == "mutator"]
    validation = [s.status() for s in steps if s.stage == "validator"]
    summary = ""
    if error is not None:
        failed = [s for s in steps if not s.ok]
        summary = "\n".join(
            f"{s.name}: {s.execution_error or f'exit code {s.exit_code}'}" for s in failed
        )
    condition = kptfile.rendered_condition(error.condition() if error is not None else "")
    return kptfile.canonical_text(
        kptfile.with_status(document, condition, mutation, validation, summary)
    )


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
    package = load_package(root)
    runner = Runner(
        evaluator,
        allow_exec=allow_exec,
        bounds=bounds or Bounds(),
        progress=progress,
        diffs=diffs,
        on_package=on_package,
    )
    before = package.all_texts()
    failure: PipelineError | None = None
    breadth_first = _flag(package.kptfile, kptfile.BFS_RENDER)
    try:
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
    if not dry_run:
        write_package(root, outcome, prune=failure is None)
    if failure is not None:
        failure.steps = runner.steps
        failure.saved = save
        raise failure
    return outcome


def evaluate_one(
    root: Path | None,
    spec: Mapping[str, Any],
    evaluator: Evaluator,
    *,
    config: Any = None,
    data: Mapping[str, str] | None = None,
    dry_run: bool = False,
    progress: Progress | None = None,
    include_meta: bool = False,
    items: list[Any] | None = None,
    results_dir: Path | None = None,
    config_file: Path | None = None,
    bounds: Bounds | None = None,
) -> Outcome:
    """``kpt fn eval``: one function (`spec`: ``image`` or ``exec``, and ``selectors`` /
    ``exclude`` as in a Kptfile) over the resources under `root` (with `include_meta`, the
    Kptfiles too), or over `items` (a ResourceList's, ``root`` None: nothing is written).
    Configured by `config` (a KRM object, ``--fn-config``) or by `data` (``-- key=value``: a
    ConfigMap)."""
    before: dict[str, str] = {}
    if root is not None:
        package = load_package(root, require_kptfile=False)
        items = package.all_resources(meta=include_meta)
        before = package.all_texts()
        if config_file is not None and config_file.resolve().is_relative_to(root.resolve()):
            # the function's own config, kept in the package, is not among its input (kpt)
            own = os.path.relpath(config_file.resolve(), root.resolve())
            items = [item for item in items if source_of(item)[0] != own]
            before.pop(own, None)  # nor is its file the function's to keep or remove
    items = list(items or [])
    if config is None and data:
        config = function_config({"configMap": dict(data)}, None, items)
    runner = Runner(evaluator, allow_exec=True, bounds=bounds or Bounds(), progress=progress)
    try:
        items = runner.run(items, spec, None, "eval", config=config)
    finally:
        if results_dir is not None:
            write_results(results_dir, runner.steps)
    outcome = outcome_of(runner.steps, before, items)
    if root is not None and not dry_run:
        write_package(root, outcome, prune=True)
    return outcome


def save_function(
    root: Path,
    spec: Mapping[str, Any],
    stage: str,
    config_path: Path | None,
    data: Mapping[str, str],
) -> str:
    """``kpt fn eval --save``: put the function that ran in the package's Kptfile pipeline
    (`stage` "mutator" or "validator"), replacing one of the same image or command. Returns
    what kpt says about it."""
    try:
        text = (root / KPTFILE).read_text()
    except FileNotFoundError:
        return "function not added: Kptfile not exists"
    document = resourcelist.load(text)
    function: dict[str, Any] = {}
    if spec.get("image"):
        function["image"] = qualified(str(spec["image"]))
    else:
        function["exec"] = str(spec["exec"])
    if config_path is not None:
        function["configPath"] = os.path.relpath(config_path.resolve(), root.resolve())
    elif data:
        function["configMap"] = dict(data)
    for key in ("selectors", "exclude"):
        if spec.get(key):
            function[key] = list(spec[key])
    pipeline = document.setdefault("pipeline", CommentedMap())
    functions = pipeline.get(f"{stage}s")
    if not isinstance(functions, list):
        functions = pipeline[f"{stage}s"] = CommentedSeq()
    name = function.get("image") or function["exec"]
    message = f'Added "{name}" as {stage} in the Kptfile.'
    node = resourcelist.block_style(function)
    for index, existing in enumerate(functions):
        same = existing.get("image") if "image" in function else existing.get("exec")
        if same == name:
            functions[index] = node
            message = f'Updated "{name}" as {stage} in the Kptfile.'
            break
    else:
        functions.append(node)
    # kpt writes the Kptfile with its sequences indented, keeping its comments
    target = root / KPTFILE
    os.replace(_stage(target, dump_text(document, "wide")), target)
    return message


def changed(path: str, before: str | None, after: str) -> bool:
    """Whether a function changed the file: its new text differs from what it was, and from
    what it was as ruamel.yaml writes it (a block scalar's indentation, say, is normalized even
    when nothing touched the resource — that alone is no reason to rewrite a file)."""
    if before is None or before == after:
        return before is None
    return render_files(read_resources(before, path)).get(path) != after


def write_package(root: Path, outcome: Outcome, *, prune: bool = True) -> None:
    """Write the changed files and (with `prune`) remove the emptied ones, all or nothing: every
    new text is staged beside its file first; only then are they renamed into place, with what
    they replace kept aside until the last one is in, so that a failure (or Ctrl-C) on the way
    puts every file back as it was. Each path must stay inside `root`."""
    root = root.resolve()
    changes: list[tuple[str, Path, str | None]] = []  # (path, target, new text or None: remove)
    paths = set(outcome.before) | set(outcome.after) if prune else set(outcome.after)
    for path in sorted(paths):
        text = outcome.after.get(path)
        if text is not None and not changed(path, outcome.before.get(path), text):
            continue
        target = root / path
        if not target.parent.resolve().is_relative_to(root):
            raise PipelineError(f"a function wrote {path}, outside the package", outcome.steps)
        if target.is_symlink():  # never read (package.py), so never written through either
            raise PipelineError(f"a function wrote {path}, which is a symlink", outcome.steps)
        changes.append((path, target, text))
    staged: dict[Path, Path] = {}
    try:
        for _, target, text in changes:
            if text is not None:
                target.parent.mkdir(parents=True, exist_ok=True)
                staged[target] = _stage(target, text)
        with _signals_held():
            _commit(changes, staged)
    except OSError as exc:
        raise PipelineError(
            f"writing the package failed, every file is as it was: {exc}", outcome.steps
        ) from None
    finally:
        for temporary in staged.values():
            temporary.unlink(missing_ok=True)
    for path, _, text in changes:
        (outcome.written if text is not None else outcome.removed).append(path)


def _stage(target: Path, text: str) -> Path:
    temporary = target.with_name(f".{target.name}.fnkernel-tmp")
    with temporary.open("w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    if target.exists():
        temporary.chmod(target.stat().st_mode & 0o7777)  # a rewrite keeps the file's mode
    return temporary


def _commit(changes: list[tuple[str, Path, str | None]], staged: dict[Path, Path]) -> None:
    """Rename the staged files into place and remove the removed ones; on any failure undo
    what was done, in reverse."""
    done: list[tuple[Path, Path | None]] = []  # (target, where its old content was kept)
    try:
        for _, target, text in changes:
            kept = None
            if target.exists():
                kept = target.with_name(f".{target.name}.fnkernel-old")
                os.replace(target, kept)
            done.append((target, kept))
            if text is not None:
                os.replace(staged[target], target)
                del staged[target]
    except BaseException:
        for target, kept in reversed(done):
            if kept is not None:
                os.replace(kept, target)
            else:
                target.unlink(missing_ok=True)
        raise
    for _, kept in done:
        if kept is not None:
            kept.unlink(missing_ok=True)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold Ctrl-C, SIGTERM and SIGHUP while the renames run (a few microseconds), so that they
    cannot stop the process half way; they are delivered right after. (Only the main thread can
    hold them; elsewhere an interrupt still unwinds through the undo in ``_commit``.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def write_results(results_dir: Path, steps: list[Step]) -> Path:
    """``results.yaml``: a ``kpt.dev/v1 FunctionResultList`` of the functions that ran."""
    results_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    for step in (s for s in steps if s.ran):
        entries.append(
            {
                **step.reference(),
                "stderr": step.stderr,
                "exitCode": step.exit_code if not step.ok else 0,
                "results": step.results,
            }
        )
    document = {
        **RESULT_LIST,
        "metadata": {"name": "fnresults"},
        "exitCode": 1 if any(not step.ok for step in steps if step.ran) else 0,
        "items": entries,
    }
    path = results_dir / "results.yaml"
    path.write_text(kptfile.canonical_text(document, kptfile.RESULTS_SCHEMA))
    return path
