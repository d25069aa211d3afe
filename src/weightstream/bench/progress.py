"""Progress lines and one-line error summaries of a bench run.

Lines are flushed at once and carry seconds since import: a run killed by a time limit keeps what it
printed, and the log says where the time went.
"""

from __future__ import annotations

import time

_T0 = time.monotonic()


def log(msg: str) -> None:
    """A progress line with seconds since import (flushed: a killed run keeps what it printed)."""
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", flush=True)


def first_line(exc: BaseException) -> str:
    """The exception's type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
