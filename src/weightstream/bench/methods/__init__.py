"""The method registry: every offload method the bench can run, in run order.

Each family of methods is one file of this package holding a `METHODS` tuple of `base.Method`s;
`FAMILIES` lists the files in run order. Adding a peer = one new file + one entry in `FAMILIES`; a
variant of an existing family (e.g. weightstream with lossless compression) = one `Method` line in
that family's file. A method whose `requires` module does not import is not registered here and is
listed, with the reason, by `unavailable()`.
"""

from __future__ import annotations

import functools
import importlib

from ..progress import first_line
from . import accelerate, diffusers, resident, weightstream
from .base import EAGER_ONLY, Method, Prepare, Undo

FAMILIES = (resident, weightstream, accelerate, diffusers)
METHODS: tuple[Method, ...] = tuple(m for family in FAMILIES for m in family.METHODS)

__all__ = ["EAGER_ONLY", "FAMILIES", "METHODS", "Method", "Prepare", "Undo", "import_error", "registry",
           "unavailable", "version_of"]


@functools.cache
def import_error(module: str) -> str | None:
    """None when `import module` works, else why not."""
    try:
        importlib.import_module(module)
        return None
    except Exception as exc:  # a broken install is as unusable as a missing one
        return f"import {module} failed ({first_line(exc)}): pip install {module}"


def registry() -> dict[str, Method]:
    """The methods that can run here, in run order: those whose required module imports."""
    return {m.name: m for m in METHODS if m.requires is None or import_error(m.requires) is None}


def unavailable() -> dict[str, str]:
    """Known methods that are not registered here, with the reason (a missing import)."""
    return {m.name: import_error(m.requires) for m in METHODS if m.name not in registry()}


def version_of(module: str) -> str | None:
    """The module's `__version__` ("?" when it has none), or None when it does not import."""
    return None if import_error(module) else getattr(importlib.import_module(module), "__version__", "?")
