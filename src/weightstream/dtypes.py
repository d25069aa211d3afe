"""Dtypes as users write them: a `torch.dtype`, or a name such as "bfloat16", "bf16", "fp16", "float32"."""

from __future__ import annotations

import contextlib

import torch

from .errors import ArgumentError

_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Return the floating-point dtype `dtype` names ("bfloat16", "bf16", "torch.float16", "fp32"...,
    case-insensitive); raises ArgumentError for anything else."""
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str):
        found = _NAMES.get(dtype.strip().lower().removeprefix("torch."))
        if found is not None:
            return found
    raise ArgumentError(
        f"dtype={dtype!r}: give a floating-point dtype, a torch.dtype or one of "
        f"{', '.join(sorted(_NAMES))}"
    )


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default dtype set to `dtype` inside the block (modules built there get it), put back after."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
