"""Errors a user can cause. Each message says what to change.

Every one is a `WeightstreamError`, so `except weightstream.WeightstreamError` catches any mistake in
what was asked; those about a bad value are also `ValueError`s.
"""


class WeightstreamError(RuntimeError):
    """Base class of every error a user of weightstream can cause."""


class ArgumentError(WeightstreamError, ValueError):
    """An argument weightstream cannot use: a size, dtype, device, strategy or token count."""


class BudgetError(WeightstreamError, ValueError):
    """A memory budget cannot hold what must stay in it; `minimum_bytes` is what would."""

    def __init__(self, message: str, minimum_bytes: int) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes


class CheckpointError(WeightstreamError):
    """The checkpoint folder is missing, incomplete, malformed, or does not match the model."""


class OffloadStateError(WeightstreamError):
    """The model is in a state offloading does not support (meta tensors, already offloaded...), or
    was asked for something an offloaded model cannot do (move, cast, copy, pickle)."""


class InferenceOnlyError(OffloadStateError):
    """Training or autograd through streamed weights: an offloaded model is for inference only."""


class PinnedMemoryError(WeightstreamError):
    """Page-locking host memory failed (container memlock limit, WSL...)."""


class HostMemoryError(WeightstreamError, MemoryError):
    """The host memory the offloaded weights need is more than this machine has available (checked
    before anything is allocated; the message gives both figures and the ways out)."""


class UnsupportedTensorError(WeightstreamError):
    """A weight whose type weightstream cannot stream exactly (named, with what to use instead)."""
