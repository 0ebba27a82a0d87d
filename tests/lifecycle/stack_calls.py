"""What the stack tests share: an echo handler, the stack factory's type, a Run's phase and
attempt."""

from __future__ import annotations

import textwrap
from collections.abc import Callable

from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.support import ECHO_PY

ECHO = {name: textwrap.dedent(text) for name, text in ECHO_PY.items()}
StackFactory = Callable[..., Stack]


def phase_and_attempt(client: Client, name: str) -> tuple[str, int]:
    status = client.status(name)["status"]
    return status["phase"], status["attempt"]
