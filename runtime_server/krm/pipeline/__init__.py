"""``kpt fn render`` / ``kpt fn eval`` semantics over the evaluator chain (docs/krm.md).

Subpackages render first; then the package's mutators run in order over its resources, its
Kptfile and its subpackages'; then its validators, each on a copy whose output is discarded.
``configMap`` becomes a ConfigMap named ``function-input``; a short image name gets the catalog
prefix; an ``exec`` step needs ``allow_exec``; ``selectors``/``exclude`` run a function on a
subset and merge the result back. After a render the top Kptfile records it (``status``). A
failure writes nothing but that status, unless the Kptfile asks to keep what succeeded
(``kpt.dev/save-on-render-failure``). Each step records the function, the evaluator that served
it, its duration, its results and the unified diff it made.

By concern: ``steps`` (what runs and what each run records), ``runner`` (one step), ``render``
(the order of packages, ``render`` and ``evaluate_one``), ``records`` (the Kptfile's status and
``results.yaml``), ``writer`` (the package's files, all or nothing), ``save`` (``fn eval
--save``).
"""

from fnkernel.runtime_server.krm.pipeline.render import evaluate_one, render
from fnkernel.runtime_server.krm.pipeline.runner import Runner, config_map
from fnkernel.runtime_server.krm.pipeline.save import save_function
from fnkernel.runtime_server.krm.pipeline.steps import (
    EXEC_NOT_ALLOWED,
    Outcome,
    PipelineError,
    PipelineFunction,
    Step,
    qualified,
)
from fnkernel.runtime_server.krm.pipeline.writer import write_package

__all__ = [
    "EXEC_NOT_ALLOWED",
    "Outcome",
    "PipelineError",
    "PipelineFunction",
    "Runner",
    "Step",
    "config_map",
    "evaluate_one",
    "qualified",
    "render",
    "save_function",
    "write_package",
]
