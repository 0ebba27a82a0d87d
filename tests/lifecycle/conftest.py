"""The pod the runtimed tests call (tests/lifecycle/pods.py); a test parametrized with
``pytest.mark.parametrize("pod", CALLS, indirect=True)`` calls it each way a caller reaches
runtimed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.lifecycle.pods import Pod, pod_of


@pytest.fixture
def pod(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Pod]:
    yield from pod_of(tmp_path, calls=getattr(request, "param", "unary"))
