"""The kernel the tests of a module share: a real kernel process through jupyter_client."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.kernel.kernels import Kernel


@pytest.fixture(scope="module")
def kernel() -> Iterator[Kernel]:
    kernel = Kernel()
    yield kernel
    kernel.shutdown()
