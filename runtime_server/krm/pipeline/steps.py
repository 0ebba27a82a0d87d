"""What a pipeline runs and what it records: a ``PipelineFunction`` of a Kptfile's pipeline (or of
``fn eval``'s flags), the ``Step`` each run of one becomes, and the ``PipelineError`` a failure
raises."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fnkernel.runtime_server.krm.evaluators.base import split_image
from fnkernel.runtime_server.krm.resources import resourcelist

if TYPE_CHECKING:
    from fnkernel.runtime_server.krm.resources.package import Package

CATALOG = "ghcr.io/kptdev/krm-functions-catalog/"
EXEC_NOT_ALLOWED = "must run with `--allow-exec` option to allow running function binaries"

Resource = Any  # a parsed KRM object: a ruamel.yaml CommentedMap, comments and style kept
Selector = Mapping[str, Any]  # apiVersion, kind, name, namespace, labels, annotations


def qualified(image: str) -> str:
    """A short image name gets the catalog prefix (kpt's rule); a full one is kept."""
    return image if "/" in image or image.startswith("fn://") else CATALOG + image


@dataclass(frozen=True)
class PipelineFunction:
    """One function of a pipeline: an ``image`` or an ``exec`` command, its config (a
    ``configMap`` or a ``configPath`` in the package) and the resources it runs on."""

    image: str = ""
    command: str = ""  # the Kptfile's `exec:`
    name: str = ""  # the Kptfile's `name:`, recorded in its status
    # The Kptfile's `tag:`, a version or semver constraint (docs/krm.md, "Image tags").
    tag: str = ""
    config_map: Mapping[str, Any] | None = None
    config_path: str = ""
    selectors: tuple[Selector, ...] = ()
    exclude: tuple[Selector, ...] = ()

    @classmethod
    def of(cls, spec: Mapping[str, Any]) -> PipelineFunction:
        """A Kptfile pipeline entry (kptfile.validate_function checked its fields' types);
        PipelineError unless it names exactly one of image and exec."""
        image = str(spec.get("image", "") or "")
        command = str(spec.get("exec", "") or "")
        if bool(image) == bool(command):
            raise PipelineError(
                f"a pipeline function needs exactly one of image or exec, got {dict(spec)}", []
            )
        config_map = spec.get("configMap")
        if config_map is not None and not isinstance(config_map, Mapping):
            raise PipelineError("configMap must be a map of strings", [])
        return cls(
            image=image,
            command=command,
            name=str(spec.get("name", "") or ""),
            tag=str(spec.get("tag", "") or ""),
            config_map=config_map,
            config_path=str(spec.get("configPath", "") or ""),
            selectors=tuple(spec.get("selectors") or ()),
            exclude=tuple(spec.get("exclude") or ()),
        )

    @property
    def label(self) -> str:
        """The image with the catalog prefix, or ``exec: COMMAND``."""
        return qualified(self.image) if self.image else f"exec: {self.command}"


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

    @property
    def error_in_results(self) -> bool:
        """Whether its error says only what one of its results says already (it may name the
        function before the message)."""
        messages = [str(result.get("message", "")) for result in self.results]
        return bool(self.error) and any(
            message and (message in self.error or self.error in message) for message in messages
        )

    @property
    def said(self) -> list[str]:
        """Its stderr's lines (a starlark script's ``print``, which kpt records), but those its
        error or a result says already (an evaluator that reports its failure on stderr too)."""
        known = [self.error, *(str(result.get("message", "")) for result in self.results)]
        return [
            line
            for line in self.stderr.strip().splitlines()
            if line.strip()
            and not any(line.strip() in text or (text and text in line) for text in known)
        ]

    @property
    def tally(self) -> str:
        """Its results counted by severity (``1 error, 2 info``; "" for none)."""
        counts: dict[str, int] = {}
        for result in self.results:
            severity = str(result.get("severity", "info"))
            counts[severity] = counts.get(severity, 0) + 1
        return ", ".join(
            f"{n} {severity}{'s' if n != 1 and severity in ('error', 'warning') else ''}"
            for severity, n in sorted(counts.items())
        )

    spec: PipelineFunction = field(
        default_factory=PipelineFunction
    )  # what ran, as the pipeline named it
    ran: bool = True  # false for a step refused before running (it gets no results entry)
    inputs: int = 0  # how many resources it was given

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def name(self) -> str:
        """How kpt names the function: its image (``:latest`` when it has neither tag nor
        digest, as kpt runs it), or the exec command."""
        if self.function.startswith("exec: "):
            return self.function.removeprefix("exec: ")
        if (
            split_image(self.function)[1]
            or "@" in self.function
            or self.function.startswith("fn://")
        ):
            return self.function
        return f"{self.function}:latest"

    @property
    def selective(self) -> bool:
        """Whether it ran on a subset of the resources (selectors or excludes)."""
        return bool(self.spec.selectors or self.spec.exclude)

    def reference(self) -> dict[str, str]:
        """``{"image": IMAGE}`` or ``{"exec": COMMAND}``, as kpt's records name a function."""
        return {"exec" if self.function.startswith("exec: ") else "image": self.name}

    def status(self) -> dict[str, Any]:
        """The step as kpt records it in the Kptfile's ``status.renderStatus``."""
        entry: dict[str, Any] = {"name": self.spec.name, **self.reference()}
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
        items: list[Resource] | None = None,
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
        # Where in kpt's render it failed, as its condition names it (with `in_step`).
        self.render_stage = "pipeline.run"

    def condition(self) -> str:
        """The message kpt writes in the Kptfile's ``Rendered`` condition."""
        why = "already handled error" if self.handled else str(self)
        if self.breadth_first_in:
            why = f"pkg {self.breadth_first_in}: {why}"
        if self.in_step:
            return f"pkg.render: pkg {self.package}:\n\t{self.render_stage}: {why}"
        return f"pkg.render: pkg {self.package}: {why}"


@dataclass
class Outcome:
    """What a render or an eval did: its steps, the package's files before and after, and its
    output resources."""

    steps: list[Step]
    before: dict[str, str]  # relative path → text
    after: dict[str, str]
    resources: list[tuple[str, str, str]]  # (kind, namespace, name) of every output resource
    written: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    items: list[Resource] = field(default_factory=list)  # the output resources, annotated


Progress = Callable[[Step], None]
PackageStarted = Callable[["Package"], None]
