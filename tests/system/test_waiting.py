"""Waiting in one place (system/waiting.py; docs/architecture.md, "Retries")."""

from __future__ import annotations

import itertools

import pytest

from fnkernel.system.waiting import Backoff, attempts, wait_for


def test_wait_for_gives_the_first_truthy_answer() -> None:
    answers = iter(["", None, "ready", "later"])
    assert wait_for(lambda: next(answers), timeout=60, interval=0) == "ready"
    assert next(answers) == "later"  # not asked again once it held


def test_wait_for_asks_once_even_with_no_time_and_then_gives_none() -> None:
    asked = itertools.count()
    assert wait_for(lambda: next(asked) and False, timeout=0, interval=1) is None
    assert next(asked) == 1


def test_wait_for_asks_once_more_when_the_time_is_up() -> None:
    # a condition that came true during the last interval counts
    asked = itertools.count()
    assert wait_for(lambda: next(asked) == 1, timeout=0.01, interval=60) is True


def test_backoff_doubles_from_its_base_up_to_its_cap_and_never_waits_before_the_first_try() -> None:
    backoff = Backoff(0.25, 1.0)
    assert [backoff.delay(n) for n in range(6)] == [0.0, 0.25, 0.5, 1.0, 1.0, 1.0]


def test_attempts_are_numbered_from_one_and_the_last_says_so() -> None:
    assert [(a.number, a.last) for a in attempts(3)] == [(1, False), (2, False), (3, True)]
    assert list(attempts(0)) == []


def test_attempts_wait_the_backoffs_delay_before_each_retry_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []
    monkeypatch.setattr("fnkernel.system.waiting.time.sleep", slept.append)
    tries = []
    for attempt in attempts(4, Backoff(0.25, 0.5)):
        tries.append((attempt.number, list(slept)))
    # none before the first try; base, doubled, capped before the retries
    assert tries == [(1, []), (2, [0.25]), (3, [0.25, 0.5]), (4, [0.25, 0.5, 0.5])]


def test_attempts_without_a_backoff_retry_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr("fnkernel.system.waiting.time.sleep", slept.append)
    for attempt in attempts(2):
        if attempt.number == 2:
            break
    assert slept == []
