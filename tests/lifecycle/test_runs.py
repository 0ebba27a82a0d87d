"""A Run's spec and its one digest (docs/protocol.md, "Runs" and "Registration")."""

from __future__ import annotations

import dataclasses

import pytest

from fnkernel.runtime_server import limits
from fnkernel.runtime_server.lifecycle.runs import Run, RunSpec, RunStatus, files_digest

FILES = {"handler.py": "def handle(event):\n    return event\n", "pkg/util.py": "X = 1\n"}
SPEC = RunSpec(
    runtime="python",
    handler="handler.handle",
    files_sha256=files_digest(FILES),
    env={"A": "1"},
    idle_timeout_seconds=60,
    memory_mb=256,
)


def test_the_digest_is_sha256_in_the_registration_digests_form() -> None:
    digest = SPEC.digest()
    assert limits.check_digest(digest) == digest


@pytest.mark.parametrize(
    "change",
    [
        {"runtime": "bash"},
        {"handler": "handler.other"},
        {"files_sha256": files_digest({**FILES, "pkg/util.py": "X = 2\n"})},
        {"files_sha256": files_digest({"handler.py": FILES["handler.py"]})},  # a file fewer
        {"files_sha256": files_digest({"other.py": FILES["handler.py"], "pkg/util.py": "X = 1\n"})},
        {"env": {"A": "2"}},
        {"env": {"A": "1", "B": "1"}},
        {"idle_timeout_seconds": 61},
        {"memory_mb": 512},
        {"replicas": 2},
    ],
)
def test_every_input_of_the_registration_changes_the_digest(change: dict[str, object]) -> None:
    # docs/protocol.md: the SHA-256 of the canonical registration inputs — the files (paths and
    # contents), handler, env, runtime, idle timeout and memory limit.
    assert dataclasses.replace(SPEC, **change).digest() != SPEC.digest()  # type: ignore[arg-type]


def test_where_a_run_came_from_and_which_replica_it_is_are_not_what_it_runs() -> None:
    # Replicas of one function register one digest; a source note is not an input.
    same = dataclasses.replace(SPEC, source="%%function cell", replica_of="fn")
    assert same.digest() == SPEC.digest()


def test_a_default_and_its_value_spelled_out_are_the_same_spec() -> None:
    # A cell without --memory and one with the default's value ask for the same function.
    implicit = dataclasses.replace(SPEC, idle_timeout_seconds=0, memory_mb=0)
    explicit = dataclasses.replace(
        SPEC,
        idle_timeout_seconds=limits.DEFAULT_IDLE_TIMEOUT_SECONDS,
        memory_mb=limits.DEFAULT_MEMORY_MB,
    )
    assert implicit.digest() == explicit.digest()


def test_the_files_digest_is_of_their_content_not_their_order() -> None:
    assert files_digest(dict(reversed(FILES.items()))) == files_digest(FILES)


def test_a_status_write_changes_the_status_alone() -> None:
    run = Run("u", "fn", SPEC, RunStatus(phase="Pending", attempt=1, assigned_pod="p"))
    written = run.with_status(phase="Ready", message="")
    assert (written.spec, written.uid, written.name) == (SPEC, "u", "fn")
    assert (written.status.phase, written.status.attempt, written.status.assigned_pod) == (
        "Ready", 1, "p",
    )  # fmt: skip
