"""weightstream: run PyTorch models whose weights do not fit in GPU memory.

    import weightstream as ws
    handle = ws.offload(model, gpu_memory="6GiB")   # in place; the model stays an nn.Module
    print(handle.stats)
    out = ws.generate(model, input_ids, max_new_tokens=64, draft="prompt-lookup")  # speculative decoding
    handle.restore()
    handle = ws.offload(pipe, gpu_memory="12GiB")  # a diffusers pipeline: one budget for all its models
    config = ws.OffloadConfig("6GiB", compress=False)  # the arguments, validated once; offload(model, config)
"""

# `weightstream.generate` names the CLI's module too: loaded here, before the function takes the name,
# no later import of the module rebinds `ws.generate`
from . import generate as _generate_command  # noqa: F401
from .config import OffloadConfig
from .errors import (
    ArgumentError,
    BudgetError,
    CheckpointError,
    HostMemoryError,
    InferenceOnlyError,
    OffloadStateError,
    PinnedMemoryError,
    UnsupportedTensorError,
    WeightstreamError,
)
from .formats.hf import from_pretrained
from .offload import OffloadHandle, OffloadStats, handle_of, offload
from .pipeline import PipelineHandle, PipelineStats
from .placement.plan import Placement
from .placement.probe import H200 as REFERENCE_PROFILE
from .placement.probe import MachineProfile
from .sizes import format_size, parse_size
from .speculative import Generation, GenerationStats, SelfDraft, generate

__all__ = [
    "REFERENCE_PROFILE",
    "ArgumentError",
    "BudgetError",
    "CheckpointError",
    "Generation",
    "GenerationStats",
    "HostMemoryError",
    "InferenceOnlyError",
    "MachineProfile",
    "OffloadConfig",
    "OffloadHandle",
    "OffloadStateError",
    "OffloadStats",
    "PinnedMemoryError",
    "PipelineHandle",
    "PipelineStats",
    "Placement",
    "SelfDraft",
    "UnsupportedTensorError",
    "WeightstreamError",
    "format_size",
    "from_pretrained",
    "generate",
    "handle_of",
    "offload",
    "parse_size",
]
__version__ = "0.1.0"
