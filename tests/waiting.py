"""Waiting in tests: poll a condition until it holds, and fail naming what never happened.

Tests wait on what they need (a heartbeat, a file, a counter), never for a fixed time. A
condition may raise to give up early, e.g. when the process it waits on has exited.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T],
    timeout_s: float,
    what: str,
    *,
    interval_s: float = 0.05,
    detail: Callable[[], object] | None = None,
) -> T:
    """Call `condition` every `interval_s` until it returns something truthy, and return that.

    After `timeout_s` without it, raise AssertionError saying what was waited for ("timed out
    after 10 s waiting for <what>"), followed by `detail()` when given (a log's tail, say). The
    condition is tried at least once, the last time at or after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            message = f"timed out after {timeout_s:g} s waiting for {what}"
            if detail is not None:
                message += f"; {detail()}"
            raise AssertionError(message)
        time.sleep(interval_s)
