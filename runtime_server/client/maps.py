"""``Client.map``'s calls (docs/protocol.md, "Replicas"): threads each taking the next item,
an item refused as busy waiting for a free replica, the first failure stopping the rest. On the
stack's machine each thread has a lane, a Run of its own, and takes the next items as a batch
called there ("Batches").
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Sequence
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
# What a lane keeps sent to its Run and not yet answered: about a quarter of its share of the
# items (as multiprocessing's Pool.map cuts its chunks), at most this many, and no more than its
# share of the items not yet sent, so that lanes that run slower still end together. It sends
# more once a quarter of that or fewer are left (``refill_at``).
BATCH_SHARE = 4
BATCH_MOST_ITEMS = 64
REFILL_SHARE = 4
REFILL_LEAST = 2  # the item that runs, and the one queued behind it in its worker


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
        go_on: bool, most: int, refill_at: int, last: bool,
    ) -> Any: ...  # fmt: skip


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
        self._batch = 1  # items a lane keeps sent, at most (``lanes``)
        self._width = 1  # the map's threads
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
        self.lane_gone = False  # a batch was refused before it ran (``Direct``'s RouteGone)

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
        """Each thread will be given a lane (``work(lane)``): how many items it keeps sent."""
        share = -(-len(self._work) // (threads * BATCH_SHARE))
        self._batch = max(1, min(share, BATCH_MOST_ITEMS))
        self._width = threads

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
        """Take the next item (with a `lane`, the next items, as its batch gets through them)
        until none is left or the map stops."""
        with self._lock:
            self._working += 1
        try:
            while taken := self._take(1 if lane is None else self._batch):
                mine = list(taken)
                try:
                    if lane is None:
                        self._one(taken.start)
                    else:
                        self._fed(lane, mine)
                except Exception as error:  # not a call's failure: every item left fails by it
                    for index in mine:
                        if not self._finished[index]:
                            self._failed(index, error)
        finally:
            with self._lock:
                self._working -= 1
                if not self._working:
                    self.over.set()

    def _take(self, count: int) -> range:
        """The next `count` items not yet taken (fewer at the end; none once the map stops)."""
        with self._lock:
            if self.stopped:
                return range(0)
            taken = range(self._next, min(self._next + count, len(self._work)))
            self._next = taken.stop
            return taken

    def _wanted(self, waiting: int, refill_at: int, message_read: bool) -> int:
        """How many more items a lane with `waiting` sent and not yet answered takes now
        (``BATCH_SHARE``): far from the end, enough to keep `_batch` sent, once few are left
        or a message of answers ends a quarter short of it; near the end (the lanes' share of
        what is left below `_batch`), that share, once few are left — half of the rest, then
        half of that, so that the lanes end together; 0: none yet."""
        share = self._share()
        if share >= self._batch:
            short = self._batch - waiting
            return short if waiting <= refill_at or (message_read and short >= refill_at) else 0
        return max(1, share) if waiting <= refill_at else 0

    def _refill_at(self) -> int:
        """When a lane wants more (``_wanted``): what it keeps sent, over REFILL_SHARE."""
        return max(REFILL_LEAST, min(self._share(), self._batch) // REFILL_SHARE)

    def _share(self) -> int:
        """A lane's share of the items not yet sent."""
        with self._lock:
            return -(-(len(self._work) - self._next) // self._width)

    def _one(self, index: int) -> None:
        try:
            result = self._invoke(index)
        except Exception as error:
            self._failed(index, error)
        else:
            self._answered(index, result)

    def _fed(self, lane: Any, mine: list[int]) -> None:
        """The items `mine` as one batch on `lane`, and more sent on as its Run gets through
        them (`mine` then names them too), but for those a batch does not carry (an Arrow
        payload, or one the spool would take): they, and any item the batch ended before
        (another caller holds the lane's Run, or it moved), are called one by one."""
        from fnkernel.runtime_server.client.direct import RouteGone

        ids: list[str] = []  # the batch's items' invocation IDs, by their place in it
        sent: list[int] = []  # and their indices in the map
        alone: list[int] = []  # called one by one, after the batch
        items = self._for_batch(mine, ids, sent, alone)
        answered = 0
        if items:
            refill_at = self._refill_at()
            closed = bool(alone) or self._next == len(self._work)
            call = self._calls.batch(
                lane, items, timeout_millis=self._timeout_millis, go_on=self._return_exceptions,
                most=len(self._work), refill_at=refill_at, last=closed,
            )  # fmt: skip
            # Live output: the item that runs now is the one after the last answered.
            live = self._follow(lane.name, ids, sent, 0)
            try:
                for offset, answer in call.answers():
                    answered = offset + 1
                    if live is not None:
                        live.ended(answer)
                        live = self._follow(lane.name, ids, sent, answered)
                    if isinstance(answer, GatewayError):
                        self._failed(sent[offset], answer)
                    else:
                        self._answered(sent[offset], answer.decoded())
                    if self.stopped:
                        return
                    waiting = len(sent) - answered
                    wanted = 0 if closed else self._wanted(waiting, refill_at, call.message_read)
                    if wanted:
                        more = list(self._take(wanted))
                        mine += more
                        items = self._for_batch(more, ids, sent, alone)
                        closed = bool(alone) or not more or self._next == len(self._work)
                        if items:
                            refill_at = self._refill_at()
                            call.more(items, refill_at, last=closed)
                            if live is None:
                                live = self._follow(lane.name, ids, sent, answered)
                        elif closed:
                            call.done()
            except RouteGone:
                self.lane_gone = True  # never called: the rest go one by one
            except FunctionBusy:
                pass  # never called: the rest go one by one
            except RequestCancelled as cancelled:
                if answered < len(sent):  # else it came after the last answer: nothing ran
                    self._failed(sent[answered], cancelled)
                return
            finally:
                call.close()
                if live is not None:
                    live.end([], wait=False)  # cancelled, or never called: nothing more comes
        for index in sent[answered:] + alone:
            if self.stopped:
                return
            self._one(index)

    def _for_batch(
        self, indices: list[int], ids: list[str], sent: list[int], alone: list[int]
    ) -> list[tuple[str, bytes, str]]:
        """The items `indices` as a batch sends them (invocation ID, input, content type), each
        then named in `ids` and `sent`, up to the first a batch does not carry: it and the rest
        go to `alone` (and every later one, once `alone` has any: the batch is closing)."""
        items: list[tuple[str, bytes, str]] = []
        for place, index in enumerate(indices):
            if alone:
                alone += indices[place:]
                break
            item = self._work[index]
            data = media = None
            # Not JSON, or a circular reference: its own call names what is wrong with it.
            with contextlib.suppress(TypeError, ValueError):
                if payloads.kind_of(item) is None:
                    data, media = payloads.encode(item, "payload")
            if data is None or media is None or len(data) >= limits.SPOOL_FROM_BYTES:
                alone += indices[place:]
                break
            items.append((limits.new_id("inv_"), data, media))
            ids.append(items[-1][0])
            sent.append(index)
        return items

    def _follow(self, name: str, ids: list[str], sent: list[int], offset: int) -> LiveFollow | None:
        """With `on_log`, the live output of the batch's item `offset`, the one that runs."""
        if self._on_log is None or offset >= len(ids):
            return None
        on_log = functools.partial(self._on_log, sent[offset])
        return self._calls.follow(name, ids[offset], on_log, in_batch=True)

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
