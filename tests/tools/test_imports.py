"""Our modules import one another without a cycle, lazy imports included (docs/architecture.md,
"Layers"), read by grimp (import-linter's graph) from the source, as `make lint` reads it."""

from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT

_CYCLES = """
import grimp
graph = grimp.build_graph("fnkernel")
ours = sorted(m for m in graph.modules if m.startswith("fnkernel"))
for module in ours:
    for imported in graph.find_modules_directly_imported_by(module):
        if imported.startswith("fnkernel") and imported != module and graph.chain_exists(
            importer=imported, imported=module
        ):
            print(module, "->", imported)
"""


def test_no_module_of_ours_imports_one_that_imports_it_back() -> None:
    found = subprocess.run(
        [sys.executable, "-c", _CYCLES], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}, check=True,
    )  # fmt: skip
    assert found.stdout == ""
