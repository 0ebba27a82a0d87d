"""``Client.map``'s calls (docs/protocol.md, "Replicas"): threads each taking the next item,
an item refused as busy waiting for a free replica, the first failure stopping the rest.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from fnkernel.runtime_server import limits
from fnkernel.runtime_server.client.errors import (
    FunctionBusy,
    GatewayError,
)
from fnkernel.runtime_server.client.live import LogCallback
from fnkernel.runtime_server.client.views import InvocationResult

MAP_PROGRESS_SECONDS = 0.05  # how often a map reports progress (and at its end)
# A map's item refused as busy (another caller holds every replica) is sent again after a wait
# that starts here and doubles up to the cap, until the item's own timeout has passed.
_BUSY_FIRST_WAIT_SECONDS = 0.002
_BUSY_WAIT_CAP_SECONDS = 0.05


class Calls(Protocol):
    """What a map asks of its client (``Client``)."""

    def invoke(
        self, name: str, payload: Any = None, *, timeout_millis: int = 0,
        on_log: LogCallback | None = None,
    ) -> InvocationResult: ...  # fmt: skip

    def cancel(self) -> int: ...


class MapRun:
    """One ``Client.map``: its threads each take the next item until none is left or the map
    stops (a failure, an interrupt). The calling thread only looks at how far it is, every
    MAP_PROGRESS_SECONDS: not once a call, which cost a fifth of a no-op map's rate."""

    def __init__(
        self,
        calls: Calls,
        name: str,
        work: list[Any],
        return_exceptions: bool,
        timeout_millis: int,
        on_log: Callable[[int, dict[str, Any]], None] | None,
    ) -> None:
        self._calls = calls
        self._name = name
        self._work = work
        self._return_exceptions = return_exceptions
        self._timeout_millis = timeout_millis
        self._on_log = on_log
        self._lock = threading.Lock()
        self._next = 0
        self._working = 0
        self.results: list[Any] = [None] * len(work)
        self.done = 0
        self.failure: BaseException | None = None
        self.stopped = False  # after a failure or an interrupt: nothing more is sent
        self._stopping = threading.Event()  # wakes the items waiting for a free replica
        self.over = threading.Event()  # every thread is out

    def stop(self) -> None:
        self.stopped = True
        self._stopping.set()
        self._calls.cancel()

    def _invoke(self, index: int) -> Any:
        """Item `index`'s output; while every replica is busy with another caller's calls
        (FunctionBusy: nothing was run), it waits for one, up to the item's timeout."""
        logged = None if self._on_log is None else functools.partial(self._on_log, index)
        timeout = limits.effective_timeout_millis(self._timeout_millis) / 1000
        deadline = time.monotonic() + timeout
        wait = _BUSY_FIRST_WAIT_SECONDS
        while True:
            try:
                return self._calls.invoke(
                    self._name, self._work[index], timeout_millis=self._timeout_millis,
                    on_log=logged,
                ).decoded()  # fmt: skip
            except FunctionBusy as busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    message = f"{busy.message}; waited {timeout:g} s for a free replica"
                    raise FunctionBusy.from_body({**busy.detail, "message": message}, 429) from None
                if self.stopped:
                    raise
                if self._stopping.wait(min(wait, left)):
                    raise
                wait = min(wait * 2, _BUSY_WAIT_CAP_SECONDS)

    def work(self) -> None:
        with self._lock:
            self._working += 1
        try:
            while True:
                with self._lock:
                    if self.stopped or self._next == len(self._work):
                        return
                    index = self._next
                    self._next += 1
                try:
                    result = self._invoke(index)
                except Exception as error:
                    if isinstance(error, GatewayError):
                        error.item = (index, len(self._work))
                    with self._lock:
                        first = not (self._return_exceptions or self.failure is not None)
                        if first:
                            self.failure = error
                        self.results[index] = error
                        self.done += 1
                    if first:
                        self.stop()
                    continue
                with self._lock:
                    self.results[index] = result
                    self.done += 1
        finally:
            with self._lock:
                self._working -= 1
                if not self._working:
                    self.over.set()
