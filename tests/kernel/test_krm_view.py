"""The view of a KRM pipeline in the notebook (docs/protocol.md, "Kernel"), drawn from its
steps as a run records them: its text form and its HTML."""

from __future__ import annotations

from fnkernel.kernel.krm import PipelineView
from fnkernel.runtime_server.krm.pipeline.steps import Step


def test_a_step_names_the_evaluators_it_fell_through_alike_in_text_and_html() -> None:
    # docs/protocol.md, "Kernel": each step's line names the evaluator that served it once,
    # after those the chain moved past (no builtin → no exec → pod); in HTML the evaluator is
    # the step's badge.
    step = Step("", "mutator", "example.com/fn:v1", evaluator="pod", skipped=("builtin", "exec"))
    view = PipelineView([step], [], title="render x")
    assert "[1] mutator example.com/fn:v1 · no builtin → no exec → pod · 0 ms · ok" in repr(view)
    html = view._repr_html_()
    assert "[1] mutator example.com/fn:v1 · no builtin → no exec · 0 ms" in html
    assert "not in" not in html
