"""KRM pipelines in the notebook (docs/protocol.md, "Pipelines", "Kernel"): ``%krm render DIR``, ``%%krm render`` (the body
is a package as multi-doc YAML with one Kptfile) and ``%%krm eval IMAGE [-- key=value ...]`` (the
body is the input resources), over the kernel's evaluator chain: builtin (with the notebook's
``fn://NAME`` functions) → exec → pod. Imported on first use only: it loads ruamel.yaml.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError

from fnkernel.kernel.display import escape, fragment, table_html, table_text
from fnkernel.kernel.output import HandlerFailedInCell
from fnkernel.kernel.session import Session, session_of
from fnkernel.runtime_server.client import parse_pairs
from fnkernel.runtime_server.client.errors import GatewayError
from fnkernel.runtime_server.errors import FunctionError
from fnkernel.runtime_server.krm.chain import Chain
from fnkernel.runtime_server.krm.functions.processes import current
from fnkernel.runtime_server.krm.pipeline import (
    Outcome,
    PipelineError,
    PipelineFunction,
    Step,
    evaluate_one,
    render,
)
from fnkernel.runtime_server.krm.resources.package import (
    INDEX_ANNOTATION,
    KPTFILE,
    LEGACY_INDEX_ANNOTATION,
    LEGACY_PATH_ANNOTATION,
    PATH_ANNOTATION,
    PackageError,
    read_documents,
)
from fnkernel.runtime_server.krm.resources.resourcelist import (
    InvalidResourceList,
    ResourceList,
    annotations_of,
    format_result,
    kind,
    yaml,
)

if TYPE_CHECKING:
    from fnkernel.kernel.functions import Function

_SEVERITY_CLASS = {"error": "fnk-error", "warning": "fnk-warn", "info": "fnk-info"}
_EVALUATOR_CLASS = {"builtin": "fnk-ok", "exec": "fnk-info", "pod": "fnk-pod"}
_STDERR_LINES = 20  # of a step's stderr in the view; the rest counted


def _trace(step: Step) -> str:
    """Who served the step, once, after the evaluators the chain moved past: ``no builtin →
    no exec → pod`` ("no" where an evaluator does not have the function). Whether the
    function succeeded is the step's outcome, said apart from it."""
    served = [step.evaluator] if step.evaluator else []
    return " → ".join([*(f"no {name}" for name in step.skipped), *served])


@dataclass(frozen=True)
class PipelineView:
    """A KRM pipeline run (``%krm``): one section per step — evaluator, time, results coloured
    by severity, the diff — then the files changed and the output resources. Each message is
    said once: a step's error only when its results do not say it, the failure itself only
    when no step shows it."""

    steps: list[Step]
    resources: list[tuple[str, str, str]]
    error: str = ""
    title: str = "KRM pipeline"
    changed: tuple[str, ...] | None = None  # the package's files written; None: not a directory
    dry_run: bool = False
    tree: tuple[tuple[str, bool], ...] = ()  # a cell's package: (file, changed) after the render

    def _summary(self, number: int, step: Step, *, badge: bool = False) -> tuple[str, str]:
        """The step's line, and its outcome (``ok`` or ``FAILED (1 error)``). With `badge`
        (the HTML, whose badge names the evaluator) the line says only what was passed over."""
        tally = step.tally
        where = f"{step.package}: " if step.package else ""
        parts = [f"[{number}] {where}{step.stage} {step.function}"]
        if not badge:
            parts.append(_trace(step) or "-")
        elif step.skipped:  # as the text says it, the badge last: no builtin → no exec
            parts.append(" → ".join(f"no {name}" for name in step.skipped))
        parts.append(f"{step.duration * 1000:.0f} ms")
        status = ("ok" if step.ok else "FAILED") + (f" ({tally})" if tally else "")
        return " · ".join(parts), status

    def _step_error(self, step: Step) -> str:
        return "" if not step.error or step.error_in_results else step.error

    def _stderr(self, step: Step) -> list[str]:
        """What the function wrote to stderr (a starlark script's ``print``) that its error and
        results do not say, at most _STDERR_LINES lines."""
        lines = step.said
        if len(lines) > _STDERR_LINES:
            lines = [*lines[:_STDERR_LINES], f"… {len(lines) - _STDERR_LINES} more lines"]
        return lines

    def _unshown_error(self) -> str:
        """The pipeline's error, unless a step shows it already (it may name the function)."""
        shown = any(
            s.error_in_results or (s.error and (s.error in self.error or self.error in s.error))
            for s in self.steps
        )
        return "" if not self.error or shown else self.error

    def _files_line(self) -> str:
        if self.changed is None or self.error:
            return ""
        files = ", ".join(self.changed) or "none"
        return (
            f"dry run, nothing written; would change: {files}"
            if self.dry_run
            else (f"files changed: {files}")
        )

    def __repr__(self) -> str:
        lines = [f"{self.title}: {len(self.steps)} step(s)" + (" — FAILED" if self.error else "")]
        for number, step in enumerate(self.steps, 1):
            summary, status = self._summary(number, step)
            lines.append(f"{summary} · {status}")
            lines += [f"    {format_result(r)}" for r in step.results]
            lines += [f"    stderr: {line}" for line in self._stderr(step)]
            if self._step_error(step):
                lines.append(f"    error: {self._step_error(step)}")
            if step.diff:
                lines += [f"    {line}" for line in step.diff.rstrip("\n").splitlines()]
        if self._unshown_error():
            lines.append(f"failed: {self._unshown_error()}")
        if self._files_line():
            lines.append(self._files_line())
        if self.tree and not self.error:
            lines += ["", "files:", *(f"  {line}" for line in tree_lines(self.tree))]
        if self.resources and not self.error:
            lines += ["", "output resources:"]
            table = table_text(["kind", "namespace", "name"], [list(r) for r in self.resources])
            lines += [f"  {line}" for line in table.splitlines()]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        sections = []
        for number, step in enumerate(self.steps, 1):
            badge = (
                f"<span class='fnk-badge {_EVALUATOR_CLASS.get(step.evaluator, 'fnk-muted')}'>"
                f"{escape(step.evaluator or '-')}</span>"
            )
            summary, status = self._summary(number, step, badge=True)
            status_class = "fnk-ok" if step.ok else "fnk-error"
            body = []
            if step.results:
                rows = (
                    [
                        f"<span class='{_SEVERITY_CLASS.get(str(r.get('severity')), '')}' "
                        f"style='font-weight:600'>{escape(r.get('severity', 'info'))}</span>",
                        escape(format_result(r).partition("]")[2].removeprefix(":").strip()),
                    ]
                    for r in step.results
                )
                body.append(table_html(["severity", "result"], rows))
            if self._stderr(step):
                said = escape("\n".join(self._stderr(step)))
                body.append(f"<div class='fnk-muted'>stderr</div><pre>{said}</pre>")
            if self._step_error(step):
                body.append(f"<pre class='fnk-error'>{escape(self._step_error(step))}</pre>")
            if step.diff:
                body.append(f"<pre>{_diff_html(step.diff)}</pre>")
            opened = " open" if not step.ok else ""
            sections.append(
                f"<details{opened}><summary>{badge} {escape(summary)} · "
                f"<span class='{status_class}' style='font-weight:600'>{escape(status)}</span>"
                f"</summary>{''.join(body)}</details>"
            )
        tail = ""
        if self._unshown_error():
            tail += f"<p class='fnk-error'>failed: {escape(self._unshown_error())}</p>"
        if self._files_line():
            tail += f"<p>{escape(self._files_line())}</p>"
        if self.tree and not self.error:
            tail += f"<p>files:</p><pre>{escape(chr(10).join(tree_lines(self.tree)))}</pre>"
        if self.resources and not self.error:
            tail += table_html(
                ["kind", "namespace", "name"], ([escape(c) for c in r] for r in self.resources)
            )
        return fragment(f"<b>{escape(self.title)}</b>{''.join(sections)}{tail}")


def tree_lines(files: tuple[tuple[str, bool], ...]) -> list[str]:
    """A package's files as an indented tree, each directory once, ``(changed)`` marked."""
    lines: list[str] = []
    shown: set[tuple[str, ...]] = set()
    for path, changed in sorted(files):
        *directories, name = path.split("/")
        for depth in range(len(directories)):
            if tuple(directories[: depth + 1]) not in shown:
                shown.add(tuple(directories[: depth + 1]))
                lines.append("  " * depth + directories[depth] + "/")
        lines.append("  " * len(directories) + name + (" (changed)" if changed else ""))
    return lines


def _diff_html(diff: str) -> str:
    lines = []
    for line in diff.splitlines():
        kind_ = "fnk-ok" if line.startswith("+") else "fnk-error" if line.startswith("-") else ""
        text = escape(line)
        lines.append(f"<span class='{kind_}'>{text}</span>" if kind_ else text)
    return "\n".join(lines)


class PipelineFailed(Exception):
    """A KRM pipeline step failed; nothing was written. Shown as one line (its results are in
    the view displayed above it)."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class PipelineInterrupted(KeyboardInterrupt):
    """The kernel was interrupted during a ``%krm`` render or eval: the step running was
    stopped, and nothing written (a render writes the package only once every step is done).
    Shown as one line, as an interrupted call is."""

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self}"]


def register(krm_chain: Chain, function: Function) -> None:
    """``%%function NAME --krm``: the function, as ``fn://NAME`` in the chain's builtin
    evaluator."""
    krm_chain.builtin.register(f"fn://{function.name}", bridge(function))


def bridge(function: Function) -> Any:
    """A registered function as a KRM function: the ResourceList goes to its handler as JSON
    and the JSON it returns is applied onto the ResourceList in place (what it did not change
    keeps its comments and style)."""

    def run(rl: ResourceList) -> None:
        payload = json.loads(json.dumps(rl.document, default=str))
        left = max(0.001, current().deadline - time.monotonic())  # the step's time limit
        try:
            output = function.invoke(payload, timeout=min(function.timeout or left, left)).output
        except HandlerFailedInCell as failed:  # it raised: its traceback under the step
            raise FunctionError(
                f"fn://{function.name}: {failed.summary()}", stderr=failed.traceback_text()
            ) from None
        except GatewayError as exc:
            raise FunctionError(f"fn://{function.name}: {exc}") from None
        try:
            rl.apply(output)
        except InvalidResourceList as exc:
            raise FunctionError(
                f"fn://{function.name} must return a ResourceList (a JSON object with items): {exc}"
            ) from None

    return run


class _Failure(Exception):
    def __init__(self, view: PipelineView) -> None:
        super().__init__(view.error)
        self.view = view


def _run(
    title: str,
    pipeline: Callable[[], Outcome],
    *,
    check: bool = True,
    files: bool = False,
    dry_run: bool = False,
    tree: bool = False,
) -> PipelineView:
    """The view of `pipeline`'s outcome; a failed step is raised as ``_Failure`` (the magic
    shows its view, then a one-line error), or returned when not `check`. `files`: the
    package is the user's directory, so the view says which of its files changed; `tree`:
    it is a cell's, so the view shows its files."""
    try:
        outcome = pipeline()
    except PipelineError as exc:
        view = PipelineView(exc.steps, [], str(exc), title)
        if check:
            raise _Failure(view) from None
        return view
    changed = (*outcome.written, *(f"{path} (removed)" for path in outcome.removed))
    shown = tuple((path, path in outcome.written) for path in outcome.after) if tree else ()
    return PipelineView(
        outcome.steps, outcome.resources, "", title, changed if files else None, dry_run, shown
    )


def run_render(
    chain: Chain,
    directory: Path,
    title: str,
    *,
    check: bool = True,
    files: bool = True,
    dry_run: bool = False,
    tree: bool = False,
) -> PipelineView:
    return _run(
        title,
        lambda: render(
            directory,
            chain.evaluator(),
            allow_exec=chain.allow_exec,
            dry_run=dry_run,
            bounds=chain.bounds,
        ),
        check=check,
        files=files,
        dry_run=dry_run,
        tree=tree,
    )


_SEPARATOR = re.compile(r"^---(?:\s|$)", re.MULTILINE)
_FILE_LINE = re.compile(r"^#\s*file:\s*(\S+)\s*$")
_WHERE = (PATH_ANNOTATION, LEGACY_PATH_ANNOTATION, INDEX_ANNOTATION, LEGACY_INDEX_ANNOTATION)


def _file_line(chunk: str) -> tuple[str, str]:
    """The file a ``# file: NAME`` line among a document's leading comments names (or
    ``""``), and the document without that line."""
    lines = chunk.splitlines()
    for index, line in enumerate(lines):
        found = _FILE_LINE.match(line.strip())
        if found:
            return found.group(1), "\n".join(lines[:index] + lines[index + 1 :]) + "\n"
        if line.strip() and not line.lstrip().startswith("#"):
            break  # the document has begun
    return "", chunk


def _file_of(document: Any, named: str, number: int) -> str:
    """Where `document` goes: its path annotation (removed, with the index), else `named`,
    else the default for its kind; UsageError for a path outside the package."""
    notes = annotations_of(document) if isinstance(document, dict) else {}
    path = next((str(notes[k]) for k in _WHERE[:2] if notes.get(k)), "") or named
    for key in _WHERE:
        notes.pop(key, None)
    if (
        isinstance(document, dict)
        and not notes
        and "annotations" in (document.get("metadata") or {})
    ):
        del document["metadata"]["annotations"]
    if not path:
        return (
            KPTFILE
            if isinstance(document, dict) and kind(document) == KPTFILE
            else "resources.yaml"
        )
    relative = posixpath.normpath(path)
    if path.startswith("/") or relative == ".." or relative.startswith("../"):
        raise UsageError(f"%%krm render: document {number} names {path!r}, outside the package")
    return relative


def cell_files(body: str) -> dict[str, list[Any]]:
    """A ``%%krm render`` cell's documents by the file each belongs in: the one its path
    annotation (either spelling) or a ``# file: NAME`` comment line before it names, else
    ``Kptfile`` for a Kptfile and ``resources.yaml`` for the rest. Neither is written."""
    files: dict[str, list[Any]] = {}
    for number, chunk in enumerate(_SEPARATOR.split(body), 1):
        named, text = _file_line(chunk)
        for document in read_documents(text, "the cell"):
            files.setdefault(_file_of(document, named, number), []).append(document)
    return files


def render_cell(chain: Chain, body: str, *, check: bool = True) -> PipelineView:
    """``%%krm render``: the body is a package (its Kptfile and resources, each document in
    the file it names, docs/protocol.md "Kernel")."""
    files = cell_files(body)
    top = [d for d in files.get(KPTFILE, []) if isinstance(d, dict) and kind(d) == KPTFILE]
    if len(top) != 1:
        raise UsageError(
            f"%%krm render: the cell needs exactly one Kptfile at the package's root, found {len(top)}"
        )
    with tempfile.TemporaryDirectory(prefix="fnkernel-krm-") as tmp:
        root = Path(tmp)
        for relative, documents in files.items():
            (root / relative).parent.mkdir(parents=True, exist_ok=True)
            _write_documents(root / relative, documents)
        name = (top[0].get("metadata") or {}).get("name", "package")
        try:
            return run_render(chain, root, f"render {name}", check=check, files=False, tree=True)
        except PackageError as exc:  # named as the cell, not the directory it was written to
            said = str(exc).replace(f' at "{tmp}"', " in the cell").replace(f"{tmp}/", "")
            raise UsageError(f"%%krm render: {said.replace(tmp, 'the cell')}") from None


def eval_cell(chain: Chain, image: str, pairs: Mapping[str, str], body: str) -> PipelineView:
    """``%%krm eval IMAGE [-- key=value ...]``: the body is the input resources."""
    documents = read_documents(body, "the cell")
    with tempfile.TemporaryDirectory(prefix="fnkernel-krm-") as tmp:
        root = Path(tmp)
        _write_documents(root / "resources.yaml", documents)
        return _run(
            f"eval {image}",
            lambda: evaluate_one(
                root,
                PipelineFunction(image=image),
                chain.evaluator(),
                data=dict(pairs),
                bounds=chain.bounds,
            ),
        )


def _write_documents(path: Path, documents: list[Any]) -> None:
    with path.open("w") as out:
        yaml().dump_all(documents, out)


def krm_magic(chain: Chain, line: str, cell: str | None) -> PipelineView:
    """Parse and run ``%krm`` / ``%%krm``; on a failed step, show the steps, then raise one line."""
    try:
        words = shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"%krm: {exc}") from None
    if not words or words[0] not in ("render", "eval"):
        raise UsageError(
            "%krm: expected `render DIR`, `%%krm render`, `%%krm eval IMAGE` or `export NAME`"
        )
    try:
        if words[0] == "render" and cell is None:
            dry_run = "--dry-run" in words
            directories = [word for word in words[1:] if word != "--dry-run"]
            if unknown := [word for word in directories if word.startswith("-")]:
                raise UsageError(f"%krm render: unknown option {unknown[0]}; it takes --dry-run")
            if len(directories) != 1:
                raise UsageError("%krm render: expected exactly one DIR (and --dry-run)")
            return run_render(
                chain, Path(directories[0]), f"render {directories[0]}", dry_run=dry_run
            )
        if words[0] == "render":
            if len(words) != 1:
                raise UsageError("%%krm render takes no arguments: the cell is the package")
            return render_cell(chain, cell or "")
        if cell is None:
            raise UsageError("%krm eval is a cell magic: %%krm eval IMAGE [-- key=value ...]")
        if len(words) < 2:
            raise UsageError("%%krm eval: IMAGE is required")
        rest = words[2:]
        if rest[:1] == ["--"]:
            rest = rest[1:]
        elif rest:
            raise UsageError(f"%%krm eval: unexpected {rest[0]!r}; put key=value pairs after --")
        try:
            pairs = parse_pairs(rest)
        except ValueError as exc:
            raise UsageError(f"%%krm eval: {exc}") from None
        return eval_cell(chain, words[1], pairs, cell)
    except _Failure as failure:
        from IPython.display import display

        display(failure.view)
        raise PipelineFailed(failure.view.error) from None
    except (FileNotFoundError, PackageError, InvalidResourceList) as exc:  # the cell's, named
        raise UsageError(f"%krm: {exc}") from None
    except KeyboardInterrupt as interrupt:
        # An fn:// step's call says what became of its handler: said too.
        call = f" ({interrupt})" if type(interrupt) is not KeyboardInterrupt else ""
        raise PipelineInterrupted(
            f"%krm {words[0]} interrupted; no file was written{call}"
        ) from None


def export_magic(session: Session, line: str, cell: str | None) -> None:
    """``%krm export NAME [-o PATH]``: the function as the gateway holds it, written as one
    executable KRM function (runtime_server/krm/export.py); prints where."""
    from fnkernel.runtime_server.krm.export import ExportError, export

    words = shlex.split(line)[1:]
    if cell is not None:
        raise UsageError("%krm export is a line magic: %krm export NAME [-o PATH]")
    if len(words) == 3 and words[1] in ("-o", "--output"):
        name, out = words[0], Path(words[2])
    elif len(words) == 1:
        name, out = words[0], Path(f"{words[0]}.pyz")
    else:
        raise UsageError("%krm export: expected NAME [-o PATH]")
    try:
        source = session.runtime.client().files(name)
        written = export(name, source["runtime"], source["handler"], source["files"], out)
    except (ExportError, GatewayError, OSError) as exc:
        raise UsageError(f"%krm export: {exc}") from None
    print(f"exported {name} to {written}: run it as `kpt fn eval --exec {written}`")


# The notebook's Python API (for what a magic line cannot say)


def chain_of(session: Session) -> Chain:
    """The session's KRM evaluator chain, created on first use and closed with the session."""
    if session.krm is None:
        session.krm = Chain()
        session.closers.append(session.krm.close)
    chain: Chain = session.krm
    return chain


def _session_chain() -> Chain:
    from IPython.core.getipython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise RuntimeError("this needs a running IPython kernel")
    return chain_of(session_of(shell))


def configure(**settings: Any) -> str:
    """Give the kernel's chain its exec and pod evaluators, and allow ``exec`` steps (see
    ``Chain.configure``); returns the chain's order, e.g. ``builtin → exec → pod``."""
    return _session_chain().configure(**settings).describe()


def render_package(body: str) -> PipelineView:
    """``%%krm render`` that returns the view even when a step fails (a failing validator is
    shown with its results, and the cell does not fail)."""
    return render_cell(_session_chain(), body, check=False)
