"""Waiting in one place (system/waiting.py; docs/architecture.md, "Retries")."""

from __future__ import annotations

import itertools

from fnkernel.system.waiting import Backoff, wait_for


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
