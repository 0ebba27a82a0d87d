"""docs/protocol.md, "Registration" as a property: random register / invoke / status / unregister sequences with random
attempts, digests and stale IDs against a real server. A stale ID never changes, invokes or removes
a newer registration, and every answer is the one the table predicts (no unexpected code)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import grpc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from tests.support import ECHO_SH, Client

OK = grpc.StatusCode.OK
_examples = itertools.count()


@dataclass
class Model:
    """What docs/protocol.md, "Registration" says the server holds for one run_uid."""

    current: tuple[int, str, str] | None = None  # (attempt, digest, registration_id)
    newest_removed: int = 0
    seen_ids: list[str] = field(default_factory=list)


def call(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    try:
        return OK, fn(*args, **kwargs)
    except grpc.RpcError as err:
        return err.code(), None


class RegistrationMachine(RuleBasedStateMachine):
    def __init__(self, client: Client) -> None:
        super().__init__()
        self.client = client
        self.prefix = f"ex{next(_examples)}"
        self.workdir = client.workdir(ECHO_SH)
        self.runs: dict[str, Model] = {}

    def model(self, run: int) -> tuple[str, Model]:
        run_uid = f"{self.prefix}-run{run}"
        return run_uid, self.runs.setdefault(run_uid, Model())

    def pick_id(self, model: Model, choice: int) -> str:
        """A current, stale or never-issued registration ID."""
        candidates = [*model.seen_ids, "reg_00000000000000000000000000"]
        return candidates[choice % len(candidates)]

    @rule(run=st.integers(0, 2), attempt=st.integers(1, 4), digest=st.sampled_from(["a", "b"]))
    def register(self, run: int, attempt: int, digest: str) -> None:
        run_uid, model = self.model(run)
        code, response = call(
            self.client.register,
            run_uid=run_uid,
            attempt=attempt,
            working_dir=self.workdir,
            digest_of=digest,
        )
        if model.current is None:
            expected = grpc.StatusCode.FAILED_PRECONDITION if attempt < model.newest_removed else OK
        else:
            current_attempt, current_digest, _ = model.current
            if attempt == current_attempt:
                expected = OK if digest == current_digest else grpc.StatusCode.ALREADY_EXISTS
            else:
                expected = OK if attempt > current_attempt else grpc.StatusCode.FAILED_PRECONDITION
        assert code == expected, (run_uid, attempt, digest, model)
        if code == OK:
            new_id = response.registration.registration_id
            assert response.state == pb.FUNCTION_REGISTRATION_STATE_READY
            if model.current is not None and model.current[0] == attempt:
                assert new_id == model.current[2]  # idempotent: the same reference
            else:
                assert new_id not in model.seen_ids  # a new generation gets a new ID
                model.seen_ids.append(new_id)
            model.current = (attempt, digest, new_id)

    @rule(run=st.integers(0, 2), choice=st.integers(0, 5))
    def invoke(self, run: int, choice: int) -> None:
        run_uid, model = self.model(run)
        registration_id = self.pick_id(model, choice)
        ref = pb.FunctionRegistration(run_uid=run_uid, registration_id=registration_id)
        code, response = call(self.client.invoke, ref, b'"ping"')
        assert code == self.fenced(model, registration_id)
        if code == OK:
            assert response.output == b'"ping"'

    @rule(run=st.integers(0, 2), choice=st.integers(0, 5))
    def status(self, run: int, choice: int) -> None:
        run_uid, model = self.model(run)
        registration_id = self.pick_id(model, choice)
        ref = pb.FunctionRegistration(run_uid=run_uid, registration_id=registration_id)
        code, response = call(self.client.status, ref)
        assert code == self.fenced(model, registration_id)
        if code == OK:
            assert response.state == pb.FUNCTION_REGISTRATION_STATE_READY

    @rule(run=st.integers(0, 2), choice=st.integers(0, 5), cancel=st.booleans())
    def unregister(self, run: int, choice: int, cancel: bool) -> None:
        run_uid, model = self.model(run)
        registration_id = self.pick_id(model, choice)
        ref = pb.FunctionRegistration(run_uid=run_uid, registration_id=registration_id)
        code, _ = call(self.client.unregister, ref, cancel=cancel)
        if model.current is None:
            assert code == OK  # absent: succeeds
        elif registration_id != model.current[2]:
            assert code == grpc.StatusCode.FAILED_PRECONDITION  # stale: the newer one is untouched
        else:
            assert code == OK
            model.newest_removed = max(model.newest_removed, model.current[0])
            model.current = None

    @staticmethod
    def fenced(model: Model, registration_id: str) -> grpc.StatusCode:
        if model.current is None:
            return grpc.StatusCode.NOT_FOUND
        if registration_id != model.current[2]:
            return grpc.StatusCode.FAILED_PRECONDITION
        return OK

    @invariant()
    def current_registrations_stay_ready(self) -> None:
        for run_uid, model in self.runs.items():
            if model.current is not None:
                ref = pb.FunctionRegistration(run_uid=run_uid, registration_id=model.current[2])
                assert self.client.status(ref).state == pb.FUNCTION_REGISTRATION_STATE_READY


def test_stale_ids_never_affect_newer_registrations(bash_rt: Client) -> None:
    run_state_machine_as_test(
        lambda: RegistrationMachine(bash_rt),
        settings=settings(
            max_examples=30,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        ),
    )
