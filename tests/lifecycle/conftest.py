"""The pod the runtimed tests call (tests/lifecycle/pods.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.lifecycle.pods import Pod, pod_of


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[Pod]:
    yield from pod_of(tmp_path)
