"""What a render records: the top Kptfile's status (kpt's ``Rendered`` condition and every
step's record) and ``results.yaml`` (docs/krm.md, "The Kptfile")."""

from __future__ import annotations

from pathlib import Path

from fnkernel.runtime_server.krm.pipeline.steps import PipelineError, Resource, Step
from fnkernel.runtime_server.krm.resources import kptfile, resourcelist
from fnkernel.runtime_server.krm.resources.package import strip_internal

RESULT_LIST = {"apiVersion": "kpt.dev/v1", "kind": "FunctionResultList"}


def status_text(kptfile_node: Resource, steps: list[Step], error: PipelineError | None) -> str:
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
