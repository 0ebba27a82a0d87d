"""The colocated Runtime Server as runtimed calls it about a Run's registration (docs/protocol.md,
"Registration"): RegisterFunction, FunctionStatus and UnregisterFunction, their deadlines, and
the reference to the registration runtimed holds (``Active``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from fnkernel.adapters.python import PACKAGES_ENV
from fnkernel.runtime_server import limits, tracing
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import (
    registrations_pb2,
    registrations_pb2_grpc,
)
from fnkernel.runtime_server.lifecycle.retries import Step, Verdict, decide
from fnkernel.runtime_server.lifecycle.runs import Run
from fnkernel.runtime_server.lifecycle.runtimed.packages import Environment
from fnkernel.runtime_server.lifecycle.secrets import Secret
from fnkernel.runtime_server.rpc import status_code
from fnkernel.runtime_server.wire import TRACEPARENT_KEY
from fnkernel.system.waiting import Backoff, attempts

LOG = logging.getLogger("fnkernel.runtimed")
_REGISTER_RPC_TRIES = 3
_REGISTER_RPC_BACKOFF = Backoff(0.2, 0.4)  # between them
_UNREGISTER_SLACK_SECONDS = 5.0  # the RPC's deadline beyond the drain it asks for


@dataclass(frozen=True)
class Active:
    """The registration runtimed holds for a Run on its server."""

    registration_id: str
    attempt: int
    digest: str
    packages: str = ""  # its requirements' environment (its lock's digest), if it has any


def registration_request(
    run: Run,
    working_dir: Path,
    environment: Environment | None = None,
    secrets: Sequence[Secret] = (),
) -> pb.RegisterFunctionRequest:
    """The RegisterFunction request of `run`'s current attempt: its digest is its spec's
    (``RunSpec.digest``), never the working dir's path (docs/protocol.md, "Registration"); with
    its requirements' `environment`, their lock's digest too, and the worker is told where it
    is (PACKAGES_ENV). Its `secrets`' keys are in its env, over the spec's own ("Secrets"): not
    in its digest, so a rotation is told by the versions the Run's status keeps."""
    env, digest = dict(run.spec.env), run.spec.digest()
    for secret in secrets:
        env.update(secret.data)
    if environment is not None:
        env[PACKAGES_ENV] = str(environment.path)
        digest = limits.sha256_digest(f"{digest} {environment.digest}".encode())
    return pb.RegisterFunctionRequest(
        run_uid=run.uid,
        registration_attempt=run.status.attempt,
        working_dir=str(working_dir),
        handler=run.spec.handler,
        env=env,
        idle_timeout_seconds=run.spec.idle_timeout_seconds,
        registration_digest=digest,
        memory_mb=run.spec.memory_mb,
    )


def reference(run_uid: str, active: Active) -> pb.FunctionRegistration:
    return pb.FunctionRegistration(run_uid=run_uid, registration_id=active.registration_id)


@dataclass(frozen=True)
class StatusRefused:
    """A FunctionStatus the server failed: its status code and message."""

    code: grpc.StatusCode
    details: str


class ServerRegistrations:
    """The calls runtimed makes to its server about registrations: through `stub`, and its poll
    through `registrations` (fnkernel's own extension)."""

    def __init__(
        self,
        stub: pb_grpc.FunctionRuntimeStub,
        registrations: registrations_pb2_grpc.RegistrationsStub,
    ) -> None:
        self.stub = stub
        self.registrations = registrations
        self._registrations_served = True  # until the server says it does not serve them
        self.answered = -math.inf  # when a poll last had an answer from the server (monotonic)

    def register(
        self, request: pb.RegisterFunctionRequest, traceparent: str = ""
    ) -> pb.RegisterFunctionResponse:
        metadata = ((TRACEPARENT_KEY, traceparent),) if traceparent else None
        response: pb.RegisterFunctionResponse = self.stub.RegisterFunction(
            request, timeout=limits.register_wait_seconds(hops_below=1), metadata=metadata
        )
        return response

    def register_repeating(
        self, request: pb.RegisterFunctionRequest, hop: tracing.Hop | tracing.Untraced
    ) -> pb.RegisterFunctionResponse:
        """RegisterFunction, each call a client span of `hop`, repeated while the server gives
        no answer (docs/protocol.md: repeating it for the same attempt is idempotent and does
        not change Run status); the error of the last call, or of one that was answered."""
        for attempt in attempts(_REGISTER_RPC_TRIES, _REGISTER_RPC_BACKOFF):
            traceparent = hop.call(
                tracing.REGISTER_SPAN, tracing.rpc_attributes("RegisterFunction")
            )
            try:
                response = self.register(request, traceparent)
            except grpc.RpcError as err:
                hop.called(err.code().value[0], None)
                if decide(Step.REGISTER, err.code()) is Verdict.WAIT and not attempt.last:
                    continue
                raise
            hop.called(0, None)
            return response
        raise AssertionError("unreachable: the last attempt returns or raises")

    def status(self, run_uid: str, active: Active) -> pb.FunctionStatusResponse:
        response: pb.FunctionStatusResponse = self.stub.FunctionStatus(
            pb.FunctionStatusRequest(registration=reference(run_uid, active)),
            timeout=limits.status_wait_seconds(hops_below=1),
        )
        return response

    def statuses(
        self, polled: Sequence[tuple[str, Active]]
    ) -> list[pb.FunctionStatusResponse | StatusRefused]:
        """The FunctionStatus of each (Run UID, registration) in `polled`, in order: in one round
        trip where the server serves fnkernel's Registrations (docs/protocol.md, "Registration"),
        else one call each. A round trip that failed fails each of them alike."""
        requests = [
            pb.FunctionStatusRequest(registration=reference(uid, active)) for uid, active in polled
        ]
        timeout = limits.status_wait_seconds(hops_below=1)
        if self._registrations_served:
            try:
                response = self.registrations.FunctionStatuses(
                    registrations_pb2.FunctionStatusesRequest(requests=requests), timeout=timeout
                )
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                    return [StatusRefused(err.code(), err.details() or "")] * len(requests)
                self._registrations_served = False  # a Runtime Server with FunctionRuntime alone
            else:
                self.answered = time.monotonic()
                return [
                    StatusRefused(status_code(answer.code), answer.message)
                    if answer.code
                    else answer.status
                    for answer in response.answers
                ]
        answers: list[pb.FunctionStatusResponse | StatusRefused] = []
        for request in requests:
            try:
                answers.append(self.stub.FunctionStatus(request, timeout=timeout))
            except grpc.RpcError as err:
                answers.append(StatusRefused(err.code(), err.details() or ""))
            else:
                self.answered = time.monotonic()
        return answers

    def fatal_error(self, run_uid: str, active: Active) -> str:
        try:
            return self.status(run_uid, active).fatal_error
        except grpc.RpcError as err:
            return err.details() or ""

    def unregister(self, uid: str, active: Active, *, cancel: bool, drain_millis: int = 0) -> bool:
        """UnregisterFunction; True once the server no longer holds `active`."""
        drain_millis = drain_millis or limits.DEFAULT_DRAIN_MILLIS
        try:
            self.stub.UnregisterFunction(
                pb.UnregisterFunctionRequest(
                    registration=reference(uid, active),
                    cancel_in_flight=cancel,
                    drain_timeout_millis=drain_millis,
                ),
                timeout=drain_millis / 1000 + _UNREGISTER_SLACK_SECONDS,
            )
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                return True  # stale: a newer registration replaced it, so this one is gone
            LOG.warning("unregistering %s: %s; will retry", uid, err.details())
            return False
        return True

    def stop_loading(self, run: Run) -> None:
        """Stop the load of `run`'s registration (deleted) if it is still loading — a handler
        that hangs as it is imported, on which runtimed's RegisterFunction waits: its worker is
        killed now, not when its load times out (docs/protocol.md, "Registration")."""
        if not self._registrations_served:  # its load ends at its bound
            return
        request = registrations_pb2.StopLoadingRequest(
            run_uid=run.uid, registration_attempt=run.status.attempt
        )
        try:
            self.registrations.StopLoading(
                request, timeout=limits.status_wait_seconds(hops_below=1)
            )
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:  # FunctionRuntime alone: once
                self._registrations_served = False
            LOG.warning("stopping %s's load: %s", run.name, err.details())

    def held(
        self, run: Run, working_dir: Path, environment: Environment | None = None
    ) -> Active | None:
        """The registration the server holds for `run` that runtimed does not know (it
        restarted): learnt by repeating the Run's registration (with its requirements'
        `environment`), which is idempotent for the same attempt and digest. None if the server
        holds nothing for it."""
        probe = reference(run.uid, Active("reg_unknown", run.status.attempt, ""))
        try:
            self.stub.FunctionStatus(
                pb.FunctionStatusRequest(registration=probe),
                timeout=limits.status_wait_seconds(hops_below=1),
            )
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return None
            if err.code() != grpc.StatusCode.FAILED_PRECONDITION:  # stale id: it holds one
                raise
        if not working_dir.is_dir():
            return None  # never registered here: nothing can be held
        request = registration_request(run, working_dir, environment)
        response = self.register(request)
        return Active(
            response.registration.registration_id,
            run.status.attempt,
            request.registration_digest,
            environment.digest if environment is not None else "",
        )
