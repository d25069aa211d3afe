"""Time limits of a bench run: a method that overruns its `--method-seconds` is interrupted with
`TimeLimitExceeded`, recorded as its error, undone, and the run goes on."""

from __future__ import annotations

import contextlib
import signal
import threading
import time


class TimeLimitExceeded(Exception):
    """A method ran past its --method-seconds."""


@contextlib.contextmanager
def time_limit(until: float, message: str):
    """Raise TimeLimitExceeded(message) in this thread once time.monotonic() passes `until`. A SIGALRM
    timer: it interrupts Python code and sleeps, but a long call inside one C function (a single huge
    copy) is interrupted only when it returns. Main thread of a POSIX process only."""
    remaining = until - time.monotonic()
    if remaining <= 0:
        raise TimeLimitExceeded(message)

    def on_alarm(signum, frame):
        raise TimeLimitExceeded(message)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, remaining)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def limit_or_none(until: float | None, message: str):
    """`time_limit(until, message)`, or no limit when `until` is None."""
    return contextlib.nullcontext() if until is None else time_limit(until, message)


def check_limits(max_seconds: float | None, method_seconds: float | None) -> None:
    """Raise ValueError for a non-positive limit, or for method_seconds where no SIGALRM timer works."""
    if max_seconds is not None and max_seconds <= 0:
        raise ValueError(f"max_seconds={max_seconds}: give a positive number of seconds, or none")
    if method_seconds is not None:
        if method_seconds <= 0:
            raise ValueError(f"method_seconds={method_seconds}: give a positive number of seconds, or none")
        if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
            raise ValueError("method_seconds needs a SIGALRM timer: the main thread of a POSIX process")
