"""``kpt fn render`` / ``kpt fn eval`` semantics over the evaluator chain (docs/protocol.md, "Pipelines").

Subpackages render first; then the package's mutators run in order over its resources and its
subpackages'; then its validators, each on a copy whose output is discarded. ``configMap``
becomes a ConfigMap named ``function-input``; a short image name gets the catalog prefix; an
``exec`` step needs ``allow_exec``; ``selectors``/``exclude`` run a function on a subset and merge
the result back. Any failure aborts before anything is written: the files are untouched. Each
step records the function, the evaluator that served it, its duration, its results and the
unified diff it made.
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
from typing import Any

from ruamel.yaml.comments import CommentedMap

from runtime_server.errors import EvaluatorError, FunctionError, NotFoundError
from runtime_server.krm.evaluators.base import EvalRequest, Evaluator
from runtime_server.krm.evaluators.wrapper import WrapperEvaluator
from runtime_server.krm.resources import resourcelist
from runtime_server.krm.resources.package import (
    Package,
    load_package,
    read_resources,
    render_files,
    source_of,
    strip_internal,
)
from runtime_server.krm.resources.resourcelist import (
    ResourceList,
    comment_columns,
    kind,
    restore_comment_columns,
)

CATALOG = "ghcr.io/kptdev/krm-functions-catalog/"
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

    @property
    def ok(self) -> bool:
        return not self.error


class PipelineError(Exception):
    """A step failed; nothing was written. ``steps`` holds every step run, the failed one last."""

    def __init__(self, message: str, steps: list[Step]) -> None:
        super().__init__(message)
        self.steps = steps


@dataclass
class Outcome:
    steps: list[Step]
    before: dict[str, str]  # relative path → text
    after: dict[str, str]
    resources: list[tuple[str, str, str]]  # (kind, namespace, name) of every output resource
    written: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


def outcome_of(steps: list[Step], before: dict[str, str], items: list[Any]) -> Outcome:
    identities = []
    for item in items:
        meta = item.get("metadata") or {}
        identities.append((kind(item), str(meta.get("namespace", "")), str(meta.get("name", ""))))
    return Outcome(steps, before, render_files(items), identities)


Progress = Callable[[Step], None]


@dataclass
class Runner:
    """Runs steps through `evaluator` (the chain); exec steps only with `allow_exec`. Builtin
    functions run on the parsed resources themselves; other evaluators get them serialized.
    With `diffs`, each step records the unified diff it made (a render of the package before
    and after: the notebook wants it, the terminal does not)."""

    evaluator: Evaluator
    allow_exec: bool = False
    timeout: float = 300.0
    progress: Progress | None = None
    diffs: bool = True
    steps: list[Step] = field(default_factory=list)

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
        step = Step(package.relative if package else "", stage, label)
        validator = stage == "validator"
        chosen = select(items, spec.get("selectors") or [], spec.get("exclude") or [])
        if config is None:
            config = function_config(spec, package, items)
        before = render_files(items) if self.diffs and not validator else {}
        # A validator works on a copy: whatever it changes is discarded.
        rl = ResourceList.of([_copy(i) for i in chosen] if validator else list(chosen), config)
        deadline = time.monotonic() + self.timeout
        started = time.perf_counter()
        try:
            if exec_command:
                log = self._exec(exec_command, rl, package, deadline)
                step.evaluator = "exec"
            else:
                log, step.evaluator, step.skipped = self._evaluate(label, rl, deadline)
        except EvaluatorError as exc:
            step.duration = time.perf_counter() - started
            step.evaluator, step.skipped = exc.evaluator, exc.skipped
            if isinstance(exc, NotFoundError):
                step.skipped = exc.tried
            step.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if isinstance(exc, FunctionError):
                step.results, step.exit_code, step.stderr = exc.results, exc.exit_code, exc.stderr
            self._record(step)
            message = step.error if label in step.error else f"{label}: {step.error}"
            raise PipelineError(message, self.steps) from None
        step.duration = time.perf_counter() - started
        step.stderr = log.decode("utf-8", "replace")
        step.results = [dict(r) for r in rl.results if isinstance(r, dict)]
        if validator:
            self._record(step)
            return items
        merged = merge(items, chosen, rl.items)
        if self.diffs:
            step.diff = diff(before, render_files(merged))
        self._record(step)
        return merged

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
        if not self.allow_exec:
            raise FunctionError(f"exec: {command}: exec functions need --allow-exec", exit_code=1)
        argv = shlex.split(command)
        if package is not None and not os.path.isabs(argv[0]) and "/" in argv[0]:
            argv[0] = str((package.root / argv[0]).resolve())
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


def _copy(node: Any) -> Any:
    """A deep copy, comments included."""
    return resourcelist.load(resourcelist.dump(node))


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
                config = _copy(item)
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
    items = list(package.resources)
    for sub in package.subpackages:
        items += _render(sub, runner)
    pipeline = package.pipeline
    for spec in pipeline.get("mutators") or []:
        items = runner.run(items, spec, package, "mutator")
    for spec in pipeline.get("validators") or []:
        runner.run(items, spec, package, "validator")
    return items


def render(
    root: Path,
    evaluator: Evaluator,
    *,
    allow_exec: bool = False,
    dry_run: bool = False,
    results_dir: Path | None = None,
    progress: Progress | None = None,
    diffs: bool = True,
) -> Outcome:
    """Render the package at `root` in place (unless `dry_run`); raises PipelineError, having
    written nothing but the results, if any step fails. `diffs`: record each step's diff."""
    package = load_package(root)
    runner = Runner(evaluator, allow_exec=allow_exec, progress=progress, diffs=diffs)
    before = package.all_texts()
    try:
        items = _render(package, runner)
    except PipelineError as exc:
        raise PipelineError(str(exc), runner.steps) from None  # every step run, to show
    finally:
        if results_dir is not None:
            write_results(results_dir, runner.steps)
    outcome = outcome_of(runner.steps, before, items)
    if not dry_run:
        write_package(root, outcome)
    return outcome


def evaluate_one(
    root: Path,
    image: str,
    evaluator: Evaluator,
    *,
    config: Any = None,
    data: Mapping[str, str] | None = None,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> Outcome:
    """``kpt fn eval IMAGE DIR``: one function over the resources under `root`, configured by
    `config` (a KRM object, ``--fn-config``) or by `data` (``-- key=value``: a ConfigMap)."""
    package = load_package(root, require_kptfile=False)
    items = package.all_resources()
    if config is None and data:
        config = function_config({"configMap": dict(data)}, package, items)
    runner = Runner(evaluator, progress=progress)
    before = package.all_texts()
    items = runner.run(items, {"image": image}, None, "eval", config=config)
    outcome = outcome_of(runner.steps, before, items)
    if not dry_run:
        write_package(root, outcome)
    return outcome


def changed(path: str, before: str | None, after: str) -> bool:
    """Whether a function changed the file: its new text differs from what it was, and from
    what it was as ruamel.yaml writes it (a block scalar's indentation, say, is normalized even
    when nothing touched the resource — that alone is no reason to rewrite a file)."""
    if before is None or before == after:
        return before is None
    return render_files(read_resources(before, path)).get(path) != after


def write_package(root: Path, outcome: Outcome) -> None:
    """Write the changed files and remove the emptied ones, all or nothing: every new text is
    staged beside its file first; only then are they renamed into place, with what they replace
    kept aside until the last one is in, so that a failure (or Ctrl-C) on the way puts every
    file back as it was. Each path must stay inside `root`."""
    root = root.resolve()
    changes: list[tuple[str, Path, str | None]] = []  # (path, target, new text or None: remove)
    for path in sorted(set(outcome.before) | set(outcome.after)):
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
    """``results.yaml``: a ``kpt.dev/v1 FunctionResultList``."""
    results_dir.mkdir(parents=True, exist_ok=True)
    document = CommentedMap(RESULT_LIST)
    document["metadata"] = CommentedMap(name="fnresults")
    document["exitCode"] = 1 if any(not step.ok for step in steps) else 0
    entries = []
    for step in steps:
        entry = CommentedMap()
        if step.function.startswith("exec: "):
            entry["exec"] = step.function.removeprefix("exec: ")
        else:
            entry["image"] = step.function
        entry["exitCode"] = step.exit_code if not step.ok else 0
        if step.results:
            entry["results"] = step.results
        if step.stderr.strip():
            entry["stderr"] = step.stderr
        entries.append(entry)
    document["items"] = entries
    path = results_dir / "results.yaml"
    path.write_text(resourcelist.dump(document).decode())
    return path
