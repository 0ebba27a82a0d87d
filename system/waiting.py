"""Waiting, in one place (docs/architecture.md, "Retries"): for a condition to hold, checked
every so often until a timeout, and how long to wait before trying something again.

Standard library only: the kernel's process loads it before any stack exists.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


def wait_for(check: Callable[[], T], *, timeout: float, interval: float) -> T | None:
    """What `check()` returns once that is truthy, asked every `interval` seconds; None if it is
    not within `timeout` seconds (``math.inf``: for ever). It is asked at least once, and once
    more when the time is up, so a condition that came true during the last interval counts."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(interval, left))


@dataclass(frozen=True)
class Backoff:
    """The wait before retry `n` (1: the first): `base` doubled each retry, at most `cap`; none
    before the first try (n = 0)."""

    base: float
    cap: float

    def delay(self, retry: int) -> float:
        if retry <= 0:
            return 0.0
        return float(min(self.cap, self.base * 2 ** (retry - 1)))


@dataclass(frozen=True)
class Attempt:
    """One try of a retried operation: `number` 1 is the first; `last` says none follows."""

    number: int
    last: bool


def attempts(limit: int, backoff: Backoff | None = None) -> Iterator[Attempt]:
    """The tries of an operation tried at most `limit` times, waiting `backoff`'s delay before
    each retry (none: at once). A retry loop is ``for attempt in attempts(...)``, left by
    ``break`` or ``return`` once a try succeeds; a try that fails for good on ``attempt.last``
    raises."""
    for number in range(1, limit + 1):
        if number > 1 and backoff is not None:
            time.sleep(backoff.delay(number - 1))
        yield Attempt(number, number == limit)
