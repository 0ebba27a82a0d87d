"""fnkernel's own batch of one Run's calls (docs/protocol.md, "Batches"), served by the Runtime
Server: each item called in turn as InvokeFunction calls one, by a thread of the batch's own,
while the RPC's thread sends the answers as they come and another reads the items the caller
sends on while the batch runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc

from fnkernel.adapters.base import NextCall
from fnkernel.runtime_server import limits
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import batches_pb2, batches_pb2_grpc
from fnkernel.runtime_server.errors import InvalidField, InvocationInFlight, ShuttingDown
from fnkernel.runtime_server.function_runtime.registry import Registry
from fnkernel.runtime_server.function_runtime.servicer import REGISTRATION_FENCE
from fnkernel.runtime_server.rpc import (
    caller_deadline,
    cancel_on_client_exit,
    failure_status,
    logs_trailer,
    metadata_map,
)
from fnkernel.runtime_server.wire import LOGS_KEY

# docs/protocol.md, "Batches": refusals of a batch's item before it is called, which end the
# batch with their status (another caller's call is in flight, the server is going away).
NEVER_CALLED = (*REGISTRATION_FENCE, InvocationInFlight, ShuttingDown)


class BatchesServicer(batches_pb2_grpc.BatchesServicer):
    """Each item called in turn, while the answers are sent as they come — those within
    limits.BATCH_SEND_SECONDS of the last sent together, unless few items are left to call."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def InvokeBatch(
        self,
        request_iterator: Iterator[batches_pb2.InvokeBatchRequest],
        context: grpc.ServicerContext,
    ) -> Iterator[batches_pb2.BatchAnswers]:
        first = next(request_iterator, None)
        if first is None:
            return  # nothing sent: nothing to call
        batch = _Batch(self.registry, first, context)
        threading.Thread(target=batch.run, name="batch", daemon=True).start()
        if not first.last:  # more may come while it runs
            threading.Thread(
                target=batch.read, args=(request_iterator,), name="batch-items", daemon=True
            ).start()
        try:
            yield from batch.sent()
        finally:
            batch.stop()  # the caller went away: nothing more is called


class _Batch:
    """One InvokeBatch: its calls (``run``, on a thread of its own), the items its caller sends
    on (``read``, on another) and its answers (``sent``)."""

    def __init__(
        self,
        registry: Registry,
        first: batches_pb2.InvokeBatchRequest,
        context: grpc.ServicerContext,
    ) -> None:
        self._registry = registry
        self._first = first
        self._context = context
        self._ready = threading.Condition()
        self._items: list[batches_pb2.BatchItem] = list(first.items)  # every item sent so far
        self._refill_at = first.refill_at
        self._closed = first.last  # the caller sends nothing more
        self._asked = False  # answers went at once for more items, none came since
        self._answers: list[batches_pb2.BatchAnswer] = []  # not sent yet
        self._send_now = False  # ``sent`` sends what it holds without waiting for its time
        self._ended = False
        self._refused: BaseException | None = None  # the status the batch ends with
        self._stopped = False
        self._send_at = 0.0  # when the answers that came since the last message may be sent

    def stop(self) -> None:
        with self._ready:
            self._stopped = True
            self._ready.notify_all()

    def read(self, requests: Iterator[batches_pb2.InvokeBatchRequest]) -> None:
        """The caller's later messages: more items, numbered on from those before."""
        try:
            for request in requests:
                if request.run_uid or request.registration_id:
                    field = "run_uid" if request.run_uid else "registration_id"
                    raise InvalidField(field, "only a batch's first message names its Run")
                with self._ready:
                    self._items.extend(request.items)
                    self._refill_at = request.refill_at
                    self._asked = False
                    self._ready.notify_all()
                if request.last:
                    break
        except InvalidField as exc:
            with self._ready:
                self._refused = self._refused or exc
                self._stopped = True
                self._ready.notify_all()
        except Exception:  # the RPC ended (cancelled, its deadline): so does the batch
            self.stop()
        finally:
            with self._ready:
                self._closed = True
                self._ready.notify_all()

    def _next(
        self, index: int
    ) -> tuple[batches_pb2.BatchItem, batches_pb2.BatchItem | None] | None:
        """Item `index` and the one after it if it came already; None once the batch is over
        (stopped, or the caller closed its side with every item called)."""
        with self._ready:
            while not self._stopped and index >= len(self._items) and not self._closed:
                self._ready.wait()
            if self._stopped or index >= len(self._items):
                return None
            following = self._items[index + 1] if index + 1 < len(self._items) else None
            return self._items[index], following

    def run(self) -> None:
        request, context = self._first, self._context
        on_dispatch = cancel_on_client_exit(context)
        queued = ""  # the item queued behind the last called, until it is called
        index = 0
        try:
            while (taken := self._next(index)) is not None:
                item, following = taken
                then = None
                if following is not None:  # for the worker to begin as it answers
                    then = NextCall(
                        following.invocation_id,
                        following.input,
                        following.content_type,
                        request.timeout_millis / 1000,
                        only_after_ok=not request.go_on,
                    )
                queued = ""
                answer = self._called(index, item, on_dispatch, then)
                queued = then.invocation_id if then is not None else ""
                index += 1
                with self._ready:
                    self._answers.append(answer)
                    if answer.code and not request.go_on:
                        return
                    # Few items left to call, and the caller may send more: it learns at once.
                    low = len(self._items) - index <= self._refill_at
                    if low and not (self._closed or self._asked):
                        self._asked = self._send_now = True
                    # The sender waits without a bound while it has nothing to send, and until
                    # its send time once it has: wake it for the first answer, when that time
                    # has come (else it wakes by itself), or to send at once.
                    if (
                        len(self._answers) == 1
                        or self._send_now
                        or time.monotonic() >= self._send_at
                    ):
                        self._ready.notify_all()
        except Exception as exc:  # NEVER_CALLED: this item and the rest were never called
            with self._ready:
                self._refused = self._refused or exc  # the stream's status, as InvokeFunction's
        finally:
            if queued:
                self._registry.cancel_queued(request.run_uid, request.registration_id, queued)
            with self._ready:
                self._ended = True
                self._ready.notify_all()

    def _called(
        self,
        index: int,
        item: batches_pb2.BatchItem,
        on_dispatch: Callable[[Callable[[], object]], None],
        then: NextCall | None,
    ) -> batches_pb2.BatchAnswer:
        try:
            invocation = self._registry.invoke(
                run_uid=self._first.run_uid,
                registration_id=self._first.registration_id,
                invocation_id=item.invocation_id,
                input=item.input,
                content_type=item.content_type,
                timeout_millis=self._first.timeout_millis,
                deadline=caller_deadline(self._context),
                on_dispatch=on_dispatch,
                then=then,
            )
        except NEVER_CALLED:
            raise
        except Exception as exc:
            code, message, trailers = failure_status(exc, "InvokeBatch")
            return batches_pb2.BatchAnswer(
                index=index,
                invocation_id=item.invocation_id,
                code=code.value[0],
                message=message,
                trailers=metadata_map(trailers),
            )
        result = invocation.result
        return batches_pb2.BatchAnswer(
            index=index,
            invocation_id=invocation.invocation_id,
            output=result.output,
            content_type=result.content_type,
            outputs=result.outputs or None,
            trailers={LOGS_KEY: logs_trailer(result.logs)} if result.logs else None,
        )

    def sent(self) -> Iterator[batches_pb2.BatchAnswers]:
        """The answers, in messages: the first as soon as it comes, then whatever came within
        limits.BATCH_SEND_SECONDS of the last message — or at once, when the caller is to send
        more items — until the batch ends."""
        while True:
            with self._ready:
                while True:
                    wait = self._send_at - time.monotonic()
                    if self._ended or (self._answers and (wait <= 0 or self._send_now)):
                        break
                    self._ready.wait(wait if self._answers else None)
                answers, self._answers = self._answers, []
                ended, self._send_now = self._ended, False
            if answers:
                yield from _messages(answers)
                with self._ready:
                    self._send_at = time.monotonic() + limits.BATCH_SEND_SECONDS
            if ended:
                break
        if self._refused is not None:
            raise self._refused


def _messages(answers: list[batches_pb2.BatchAnswer]) -> Iterator[batches_pb2.BatchAnswers]:
    """`answers`, in order, in as few messages as hold them within limits.BATCH_MESSAGE_BYTES
    each (an answer larger than that in a message of its own)."""
    taken: list[batches_pb2.BatchAnswer] = []
    size = 0
    for answer in answers:
        answer_size = answer.ByteSize()
        if taken and size + answer_size > limits.BATCH_MESSAGE_BYTES:
            yield batches_pb2.BatchAnswers(answers=taken)
            taken, size = [], 0
        taken.append(answer)
        size += answer_size
    if taken:
        yield batches_pb2.BatchAnswers(answers=taken)
