"""Errors a user can cause. Each message says what to change."""


class WeightstreamError(RuntimeError):
    """Base class for weightstream's runtime errors."""


class BudgetError(ValueError):
    """The GPU memory budget cannot hold what must stay on the GPU; `minimum_bytes` is what would."""

    def __init__(self, message: str, minimum_bytes: int) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes


class OffloadStateError(WeightstreamError):
    """The model is in a state offloading does not support (training, meta tensors, already offloaded...)."""


class PinnedMemoryError(WeightstreamError):
    """Page-locking host memory failed (container memlock limit, WSL...)."""


class UnsupportedTensorError(WeightstreamError):
    """A weight whose type weightstream cannot stream exactly (named, with what to use instead)."""
