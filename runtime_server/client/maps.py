"""``Client.map``'s calls (docs/protocol.md, "Replicas"): threads each taking the next item,
an item refused as busy waiting for a free replica, the first failure stopping the rest. On the
stack's machine each thread has a lane, a Run of its own, and takes the next items as a batch
called there ("Batches").
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, Protocol

from fnkernel.runtime_server import limits, payloads
from fnkernel.runtime_server.client.errors import (
    FunctionBusy,
    GatewayError,
    RequestCancelled,
)
from fnkernel.runtime_server.client.live import FOLLOW_END_SECONDS, LiveFollow, LogCallback
from fnkernel.runtime_server.client.views import InvocationResult

MAP_PROGRESS_SECONDS = 0.05  # how often a map reports progress (and at its end)
# A map's item refused as busy (another caller holds every replica) is sent again after a wait
# that starts here and doubles up to the cap, until the item's own timeout has passed.
_BUSY_FIRST_WAIT_SECONDS = 0.002
_BUSY_WAIT_CAP_SECONDS = 0.05
# A lane's batch: about a quarter of its share of the items (as multiprocessing's Pool.map cuts
# its chunks), so that lanes that run slower still end together, and at most this many.
BATCH_SHARE = 4
BATCH_MOST_ITEMS = 64


class Calls(Protocol):
    """What a map asks of its client (``Client``)."""

    def invoke(
        self, name: str, payload: Any = None, *, timeout_millis: int = 0,
        on_log: LogCallback | None = None, run_uid: str = "",
    ) -> InvocationResult: ...  # fmt: skip

    def cancel(self) -> int: ...

    def follow(
        self, name: str, invocation_id: str, on_log: LogCallback, *, in_batch: bool = False
    ) -> LiveFollow: ...

    def batch(
        self, lane: Any, items: Sequence[tuple[str, bytes, str]], *, timeout_millis: int,
        go_on: bool,
    ) -> Generator[tuple[int, InvocationResult | GatewayError], None, None]: ...  # fmt: skip


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
        run_uid: str = "",
    ) -> None:
        self._calls = calls
        self._run_uid = run_uid
        self._name = name
        self._work = work
        self._return_exceptions = return_exceptions
        self._timeout_millis = timeout_millis
        self._on_log = on_log
        self._batch = 1  # items a lane takes at once (``lanes``)
        self._lock = threading.Lock()
        self._next = 0
        self._working = 0
        self.results: list[Any] = [None] * len(work)
        self.done = 0
        self._finished = bytearray(len(work))  # 1 where an item's result (or failure) is in
        self._handed = 0  # the items ``in_order`` has handed out
        self.failure: BaseException | None = None
        self.stopped = False  # after a failure or an interrupt: nothing more is sent
        self.cancelled = False  # by its client's cancel()
        self._stopping = threading.Event()  # wakes the items waiting for a free replica
        self.over = threading.Event()  # every thread is out

    def through(
        self,
        lanes: list[Any],
        width: int,
        progress: Callable[[int, int], None] | None,
        on_result: Callable[[int, Any], None] | None,
    ) -> list[Any]:
        """Run the map on `width` threads, each with one of `lanes` in turn (None: calls
        through the gateway), the calling thread reporting `progress` and handing results
        on in order (``Client.map``); the results, or the map's failure (RequestCancelled if
        its client cancelled it)."""
        if lanes[0] is not None:
            self.lanes(width)
        threads = [
            threading.Thread(
                target=self.work, args=(lanes[i % len(lanes)],), name="map", daemon=True
            )
            for i in range(width)
        ]
        try:
            for thread in threads:
                thread.start()
            shown = -1
            while not self.over.wait(MAP_PROGRESS_SECONDS) or shown != self.done:
                if on_result is not None:
                    for index, result in self.in_order():
                        on_result(index, result)
                if progress is not None and (shown != self.done or not self.over.is_set()):
                    shown = self.done
                    progress(shown, len(self._work))  # also unchanged: the map is alive
                elif self.over.is_set():
                    break
            for thread in threads:
                thread.join()
            if on_result is not None:
                for index, result in self.in_order():
                    on_result(index, result)
        except BaseException:
            self.stop()
            for thread in threads:
                thread.join(FOLLOW_END_SECONDS)
            raise
        if self.cancelled:
            raise RequestCancelled(
                f"the map of {self._name} was cancelled: its calls in flight were cancelled, "
                "and the items not yet sent were never sent",
                code="CANCELLED",
            )
        if self.failure is not None:
            raise self.failure
        return self.results

    def lanes(self, threads: int) -> None:
        """Each thread will be given a lane (``work(lane)``): the size of its batches."""
        share = -(-len(self._work) // (threads * BATCH_SHARE))
        self._batch = max(1, min(share, BATCH_MOST_ITEMS))

    def cancel(self) -> None:
        """From another thread (``Client.cancel``): stop, the map then raising
        RequestCancelled."""
        self.cancelled = True
        self.stop()

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
                    on_log=logged, run_uid=self._run_uid,
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

    def work(self, lane: Any = None) -> None:
        """Take the next item (with a `lane`, the next batch of them) until none is left or
        the map stops."""
        with self._lock:
            self._working += 1
        try:
            while True:
                with self._lock:
                    if self.stopped or self._next == len(self._work):
                        return
                    taken = range(self._next, min(self._next + self._batch, len(self._work)))
                    self._next = taken.stop
                try:
                    if lane is None:
                        self._one(taken.start)
                    else:
                        self._batched(lane, taken)
                except Exception as error:  # not a call's failure: every item left fails by it
                    for index in taken:
                        if not self._finished[index]:
                            self._failed(index, error)
        finally:
            with self._lock:
                self._working -= 1
                if not self._working:
                    self.over.set()

    def _one(self, index: int) -> None:
        try:
            result = self._invoke(index)
        except Exception as error:
            self._failed(index, error)
        else:
            self._answered(index, result)

    def _batched(self, lane: Any, taken: range) -> None:
        """The items `taken` as one batch on `lane`, but for those a batch does not carry (an
        Arrow payload, or one the spool would take): they, and any item the batch ended
        before (another caller holds the lane's Run, or it moved), are called one by one."""
        items: list[tuple[str, bytes, str]] = []
        for index in taken:
            item = self._work[index]
            if payloads.kind_of(item) is not None:
                break
            try:
                data, media = payloads.encode(item, "payload")
            except (TypeError, ValueError):  # not JSON, or a circular reference
                break  # its own call names what is wrong with it
            if len(data) >= limits.SPOOL_FROM_BYTES:
                break
            items.append((limits.new_id("inv_"), data, media))
        answered = 0
        if items:
            from fnkernel.runtime_server.client.direct import RouteGone

            answers = self._calls.batch(
                lane, items, timeout_millis=self._timeout_millis, go_on=self._return_exceptions
            )
            # Live output: the item that runs now is the one after the last answered.
            live = self._follow(lane.name, items, taken, 0)
            try:
                for offset, answer in answers:
                    answered = offset + 1
                    if live is not None:
                        live.ended(answer)
                        live = self._follow(lane.name, items, taken, answered)
                    if isinstance(answer, GatewayError):
                        self._failed(taken[offset], answer)
                    else:
                        self._answered(taken[offset], answer.decoded())
                    if self.stopped:
                        return
            except (RouteGone, FunctionBusy):
                pass  # never called: the rest go one by one
            except RequestCancelled as cancelled:
                if answered < len(taken):  # else it came after the last answer: nothing ran
                    self._failed(taken[answered], cancelled)
                return
            finally:
                answers.close()
                if live is not None:
                    live.end([], wait=False)  # cancelled, or never called: nothing more comes
        for index in taken[answered:]:
            if self.stopped:
                return
            self._one(index)

    def _follow(
        self, name: str, items: list[tuple[str, bytes, str]], taken: range, offset: int
    ) -> LiveFollow | None:
        """With `on_log`, the live output of the batch's item `offset`, the one that runs."""
        if self._on_log is None or offset >= len(items):
            return None
        on_log = functools.partial(self._on_log, taken[offset])
        return self._calls.follow(name, items[offset][0], on_log, in_batch=True)

    def in_order(self) -> list[tuple[int, Any]]:
        """The items finished since the last call whose items before them have all finished,
        each with its result: in input order, each once. Without return_exceptions they end
        before the first item that failed (the map's failure, or a call it cancelled)."""
        with self._lock:
            start = self._handed
            while self._handed < len(self._work) and self._finished[self._handed]:
                failed = isinstance(self.results[self._handed], BaseException)
                if failed and not self._return_exceptions:
                    break
                self._handed += 1
            return [(index, self.results[index]) for index in range(start, self._handed)]

    def _answered(self, index: int, result: Any) -> None:
        with self._lock:
            self.results[index] = result
            self._finished[index] = 1
            self.done += 1

    def _failed(self, index: int, error: Exception) -> None:
        """Item `index` failed: its failure is the map's, unless one came first or the map
        returns each in its place."""
        if isinstance(error, GatewayError):
            error.item = (index, len(self._work))
        elif isinstance(error, TypeError | ValueError):  # an item that could not be sent (not
            error = _naming_item(error, index, len(self._work))  # JSON, not Arrow): named so
        with self._lock:
            first = not (self._return_exceptions or self.failure is not None)
            if first:
                self.failure = error
            self.results[index] = error
            self._finished[index] = 1
            if not (self.stopped and isinstance(error, RequestCancelled)):
                self.done += 1  # a call the map's own stop cancelled did not end: not done
        if first:
            self.stop()


def _naming_item(error: Exception, index: int, total: int) -> Exception:
    """`error` of item `index`, its message ending as a GatewayError's of a map does (``index 5
    of 200 items``) and its ``item`` set; `error` itself if its class takes no message."""
    try:
        named = type(error)(f"{error} (index {index} of {total} items)")
    except Exception:  # a class of its own arguments (UnicodeDecodeError's five, say)
        return error
    named.item = (index, total)  # type: ignore[attr-defined]
    return named
