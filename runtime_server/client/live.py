"""Live output for ``Client.invoke(on_log=)`` (docs/protocol.md, "Live output"): a call that has
not answered within FOLLOW_AFTER_SECONDS is followed on a stream of its own, and its answer
gives on_log the lines the stream did not.
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from fnkernel.adapters.calllogs import NOT_KEPT, lines_in
from fnkernel.runtime_server import limits
from fnkernel.runtime_server.client.errors import (
    GatewayError,
    HandlerFailed,
    InvocationTimedOut,
)
from fnkernel.runtime_server.client.transport import Transport, quote

# A call with an on_log that has not answered by then is followed; how long its answer waits
# for the stream's last lines.
FOLLOW_AFTER_SECONDS = 0.05
FOLLOW_END_SECONDS = 2.0
LogCallback = Callable[[dict[str, Any]], None]


class _Later:
    """One thread that runs each callback `delay` seconds after it was added: a call that
    answers sooner costs no thread of its own. Every callback has the same delay, so they fall
    due in the order added; the thread wakes at most every _TICK_SECONDS while any wait, not
    once a call."""

    _TICK_SECONDS = 0.02

    def __init__(self, delay: float) -> None:
        self._delay = delay
        self._cond = threading.Condition()
        self._due: collections.deque[tuple[float, Callable[[], None]]] = collections.deque()
        self._thread: threading.Thread | None = None

    def call_later(self, callback: Callable[[], None]) -> None:
        with self._cond:
            self._due.append((time.monotonic() + self._delay, callback))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fn-later", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due:
                    self._cond.wait()
                now = time.monotonic()
                ready = []
                while self._due and self._due[0][0] <= now:
                    ready.append(self._due.popleft()[1])
                wait = self._due[0][0] - now if self._due else 0.0
            for callback in ready:
                callback()
            if wait > 0:  # the next is due then, and every one added meanwhile after it
                time.sleep(max(wait, self._TICK_SECONDS))


_LATER = _Later(FOLLOW_AFTER_SECONDS)
# A batch's item (docs/protocol.md, "Batches"): the answers of the items before it come up to
# BATCH_SEND_SECONDS late, so it is known to run only once that much more has passed.
_LATER_IN_BATCH = _Later(FOLLOW_AFTER_SECONDS + limits.BATCH_SEND_SECONDS)


class LiveFollow:
    """Follows one invocation's log lines for `on_log`, once it is due (``Client.invoke``)."""

    def __init__(
        self,
        client: Transport,
        name: str,
        invocation_id: str,
        on_log: LogCallback,
        *,
        in_batch: bool = False,
    ):
        self._client = client
        self._name = name
        self._invocation_id = invocation_id
        self._on_log = on_log
        self._lock = threading.Lock()
        self._ended = False
        self._thread: threading.Thread | None = None
        self._connection: http.client.HTTPConnection | None = None
        self._closed = False
        self.shown = 0  # lines given to on_log while the call ran
        self._shown_of: collections.Counter[str] = collections.Counter()  # ... by stream
        self.complete = False  # the stream ended with the invocation
        self.cut = False  # ... after its cap: the last lines were not streamed
        (_LATER_IN_BATCH if in_batch else _LATER).call_later(self._start)

    def at(self, name: str) -> None:
        """The call went to the Run `name` (a replica a client picked itself: docs/protocol.md,
        "Replicas"): follow it there, unless the following has begun."""
        with self._lock:
            self._name = name

    def _start(self) -> None:
        with self._lock:
            if self._ended:
                return
            self._connection = self._client._connect(timeout=None)
            self._thread = threading.Thread(target=self._follow, name="fn-follow", daemon=True)
            self._thread.start()

    def _follow(self) -> None:
        assert self._connection is not None
        path = (
            f"/v1/runs/{quote(self._name)}/invocations/{quote(self._invocation_id)}/logs?follow=1"
        )
        try:
            for record in self._client._records(self._connection, path):
                if self._closed:
                    return
                if "stream" in record:
                    self.cut = self.cut or bool(record.get("cut"))
                    self._on_log(record)
                    self.shown += 1
                    if not record.get("cut"):
                        self._shown_of[str(record["stream"])] += 1
                elif record.get("end"):
                    self.complete = True
        except GatewayError:
            pass  # not found, too many followers, cancelled: the result's lines stand in

    def ended(self, outcome: Any) -> None:
        """The call is over with `outcome`, its result or its failure: ``end`` with the lines
        it carries — a result's, a handler error's, a timeout's. Any other failure never ran
        or was cancelled: nothing more comes."""
        if isinstance(outcome, (HandlerFailed, InvocationTimedOut)):
            self.end(outcome.logs)
        elif isinstance(outcome, BaseException):
            self.end([], wait=False)
        else:
            self.end(outcome.logs)  # an InvocationResult

    def end(self, logs: list[dict[str, Any]], *, wait: bool = True) -> None:
        """The call is over with `logs` (its result's): take the stream's last lines (for a
        bounded while), then give on_log what the stream did not."""
        with self._lock:
            self._ended = True
            thread, connection = self._thread, self._connection
        if thread is not None:
            thread.join(FOLLOW_END_SECONDS if wait else 0.2)
            if thread.is_alive() and connection is not None and connection.sock is not None:
                with contextlib.suppress(OSError):
                    connection.sock.shutdown(socket.SHUT_RDWR)
                thread.join()
        self._closed = True  # a stream still connecting gives on_log nothing now
        if self.complete and not self.cut:
            return
        if self.cut or any(line.get("cut") for line in logs):
            # The result carries the log's last 4 KiB: the call's whole log (its first and
            # last 512 KiB, "Limits") is its server's until its Run's next call ends.
            stored = self._stored()
            logs = logs if stored is None else stored
        if self.shown and logs:
            self._on_log(
                {"stream": "stderr", "text": "[fnkernel: the call's log, from its result:]"}
            )
        for line in logs:
            self._on_log(line)

    def _stored(self) -> list[dict[str, Any]] | None:
        """The call's log as its server keeps it once the call is over, less what the live
        stream showed of each stream; None if the server has it no more (another call of the
        Run has ended since: a batch's next item)."""
        try:
            records = self._client.follow_logs(self._name, self._invocation_id, follow=False)
            stored = [record for record in records if "stream" in record]
        except GatewayError:
            return None
        # Walked stream by stream, each record at the place of its stream's lines it holds:
        # those the live stream showed are left out. The kept lines are stdout's, then
        # stderr's; when the first of them were left out (a line says how many), they were
        # stdout's as long as some of stdout's are kept. A stream's dropped middle is one line
        # standing for many (``lines_in``): shown if the stream did not show them all, and
        # after one whose lines nobody counted, the rest is shown (the live stream ends
        # within a stream's first half MiB, before any such middle).
        shown = collections.Counter(self._shown_of)
        at: collections.Counter[str] = collections.Counter()
        if stored and (found := NOT_KEPT.fullmatch(str(stored[0].get("text", "")))):
            if any(record["stream"] == "stdout" for record in stored):
                at["stdout"] = int(found[1])
            else:
                shown.clear()
        uncounted: set[str] = set()
        lines = []
        for record in stored:
            stream, text = str(record["stream"]), str(record.get("text", ""))
            if NOT_KEPT.fullmatch(text):
                lines.append(record)
                continue
            count = lines_in(text)
            if count is None:
                uncounted.add(stream)
            if stream in uncounted or at[stream] + (count or 0) > shown[stream]:
                lines.append(record)
            at[stream] += count or 0
        return lines
