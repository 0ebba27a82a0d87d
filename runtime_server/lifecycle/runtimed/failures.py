"""What runtimed does when a registration of a Run fails (docs/protocol.md, "Runs"): the retry
engine's verdict applied to the Run's status — failed for good, or handed back for another
attempt, charged or not."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping

import grpc

from fnkernel.runtime_server import limits
from fnkernel.runtime_server.lifecycle.retries import Step, Verdict, decide, fatal_error_type
from fnkernel.runtime_server.lifecycle.runs import Run, RunStore
from fnkernel.runtime_server.lifecycle.runtimed.server import Active
from fnkernel.runtime_server.wire import FAILED, RETRYING

LOG = logging.getLogger("fnkernel.runtimed")
UNSUPPORTED = "runtime does not support function mode"
# A Run whose calls were in flight this many times in a row when its server died is Failed: the
# retry budget's size, for a fault the budget does not see (the pod's deaths are never charged).
MAX_SERVER_DEATHS = 3


class RunFailures:
    """Runtimed's handling of failed registrations, over its store, lock and registrations."""

    store: RunStore
    _lock: threading.Lock
    _active: dict[str, Active]
    _cut_off: dict[str, tuple[Active, str]]

    def _heartbeat(self, *, now: bool = False, answered: float = -math.inf) -> None:
        raise NotImplementedError  # Runtimed's: its pod's heartbeat

    def _fatal(self, run: Run, fatal_error: str) -> None:
        """A FAILED registration: retry what the platform caused, fail the handler's faults for
        good (docs/protocol.md, "Runs": user-code init failures → Failed, no retry)."""
        if decide(Step.LOAD, fatal_error_type(fatal_error)) is Verdict.RETRY_CHARGED:
            self._infrastructure_failure(run, fatal_error)
        else:
            self._failed(run, fatal_error)

    def _failed(self, run: Run, message: str, secrets: Mapping[str, str] | None = None) -> None:
        """`secrets`: the versions of its secrets, when a missing one failed it (``poll``)."""
        versions = run.status.secret_versions if secrets is None else secrets
        self.store.update(
            run, phase=FAILED, message=limits.bounded(message), secret_versions=versions
        )
        LOG.warning("run %s failed: %s", run.name, message)

    def _infrastructure_failure(
        self, run: Run, message: str, *, charged: bool = True, server_deaths: int | None = None
    ) -> None:
        """Hand the Run to the retry engine. `charged`: the attempt counts against the Run's
        retry budget — not when the pod was down (README, "Runs, runtimed and the gateway"). `server_deaths`: the Run's new
        count of them (``registration_lost``), if it changed."""
        with self._lock:
            self._active.pop(run.uid, None)
        # So that the retry engine sees at once whether this pod can take a retry.
        self._heartbeat(now=True)
        self.store.update(
            run,
            phase=RETRYING,
            message=limits.bounded(message),
            failed_at=time.time(),
            uncharged_attempts=run.status.uncharged_attempts + int(not charged),
            server_deaths=run.status.server_deaths if server_deaths is None else server_deaths,
        )
        LOG.warning("run %s attempt %d: %s; retrying", run.name, run.status.attempt, message)

    def registration_lost(self, run: Run, active: Active, how: str = "") -> None:
        """The server answered NOT_FOUND for `active`: it restarted. Retry, free of charge —
        unless the Run's own calls were in flight the last MAX_SERVER_DEATHS times the server
        died: then its handler is likely what kills it, and the Run is Failed, saying so."""
        with self._lock:
            if self._active.get(run.uid) != active:
                return  # already handled, or registered again meanwhile
            cut_off = self._cut_off.pop(run.uid, None)
        message = how or "the Runtime Server lost the registration (restarted)"
        if cut_off is None or cut_off[0] != active:
            self._infrastructure_failure(run, message, charged=False)
            return
        deaths = run.status.server_deaths + 1
        if deaths >= MAX_SERVER_DEATHS:
            with self._lock:
                self._active.pop(run.uid, None)
            reason = (
                f"its calls were in flight each of the last {deaths} times its Runtime Server "
                f"died (the last: {cut_off[1]}): its handler may be killing the server"
            )
            self._failed(run, reason)
            return
        self._infrastructure_failure(
            run, f"{message}, with call {cut_off[1]} in flight", charged=False, server_deaths=deaths
        )

    def call_cut_off(self, run: Run, active: Active, invocation_id: str) -> None:
        """A proxied call on `active` broke off: the server may have died under it."""
        with self._lock:
            self._cut_off[run.uid] = (active, invocation_id)

    def _registration_failed(
        self, run: Run, verdict: Verdict, code: grpc.StatusCode, details: str
    ) -> None:
        if verdict is Verdict.WAIT:
            # The server did not answer (down, or paused): nothing was registered, so nothing is
            # superseded. The Run stays as it is and the next pass repeats the same attempt; if
            # the pod is really gone, the control plane moves the Run once its grace is over.
            waits = f"RegisterFunction: {code.name}: {details}; will try again"
            LOG.warning("run %s attempt %d: %s", run.name, run.status.attempt, waits)
        elif verdict is Verdict.FATAL:
            # UNIMPLEMENTED is permanent: never a fallback to one-shot Execute (docs/protocol.md).
            self._failed(run, UNSUPPORTED if code == grpc.StatusCode.UNIMPLEMENTED else details)
        else:
            message = f"RegisterFunction: {code.name}: {details}"
            self._infrastructure_failure(run, message, charged=verdict is Verdict.RETRY_CHARGED)
