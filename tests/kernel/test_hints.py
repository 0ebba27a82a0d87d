"""What a failed registration's card offers to fix (docs/protocol.md, "What a handler sees",
"Requirements"), from the failure's words and what the kernel has."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from fnkernel.kernel import include


def test_a_module_the_runtime_lacks_and_the_kernel_has_is_offered_as_a_requirement(
    tmp_path: Path,
) -> None:
    # A shared stack's environment is not the kernel's: the kernel names its own version.
    version = metadata.version("pytest")
    hint = include.hint(
        "ImportModuleError: No module named 'pytest'", "import pytest\n", {}, tmp_path
    )
    assert hint == (
        f"pytest is not installed in the runtime; your kernel has pytest {version}: "
        f"add --requirements pytest=={version}"
    )


def test_a_module_named_for_another_distribution_is_offered_by_the_distributions_name(
    tmp_path: Path,
) -> None:
    # The import name is not always the distribution's: `google.protobuf` comes in protobuf.
    version = metadata.version("protobuf")
    hint = include.hint("No module named 'google.protobuf'", "", {}, tmp_path)
    assert "add --requirements protobuf==" + version in hint


def test_a_module_beside_the_notebook_is_offered_as_an_include_first(tmp_path: Path) -> None:
    (tmp_path / "pytest.py").write_text("")  # a local module shadows the installed one
    hint = include.hint("No module named 'pytest'", "import pytest\n", {}, tmp_path)
    assert hint == "pytest.py is beside the notebook: ship it with --include pytest.py"


def test_a_module_nobody_has_offers_nothing(tmp_path: Path) -> None:
    assert include.hint("No module named 'no_such_module_anywhere'", "", {}, tmp_path) == ""
