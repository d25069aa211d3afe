"""weightstream: run PyTorch models whose weights do not fit in GPU memory.

    import weightstream as ws
    handle = ws.offload(model, gpu_memory="6GiB")   # in place; the model stays an nn.Module
    print(handle.stats)
    handle.restore()
"""

from .errors import BudgetError, OffloadStateError, PinnedMemoryError, WeightstreamError
from .offload import OffloadHandle, OffloadStats, offload
from .plan import Placement
from .sizes import format_size, parse_size

__all__ = [
    "BudgetError",
    "OffloadHandle",
    "OffloadStateError",
    "OffloadStats",
    "PinnedMemoryError",
    "Placement",
    "WeightstreamError",
    "format_size",
    "offload",
    "parse_size",
]
__version__ = "0.1.0"
