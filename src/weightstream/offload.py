"""`offload(model, gpu_memory=...)`: the front door. A model is offloaded in place (`handle.py`), a
diffusers pipeline as a whole (`pipeline.py`)."""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn

from .config import OffloadConfig, config_of
from .handle import OffloadHandle, OffloadStats, handle_of, offload_module
from .pipeline import PipelineHandle, is_pipeline, offload_pipeline, refuse_per_model_options
from .placement.plan import Placement
from .placement.probe import MachineProfile

__all__ = ["OffloadHandle", "OffloadStats", "handle_of", "offload"]


def offload(
    model: nn.Module,
    gpu_memory: int | str | OffloadConfig = "auto",
    *,
    device: str | torch.device | None = None,
    pin_memory: bool = True,
    blocks: list[str] | None = None,
    strategy: str = "auto",
    tokens: int = 1,
    profile: MachineProfile | None = None,
    placement: Placement | None = None,
    compress: bool | str = "auto",
    check: bool | None = None,
    keep_resident: Collection[str] = (),
    expert_cache: bool = True,
    routing_skew: float | None = None,
    expert_copies: bool = False,
) -> OffloadHandle | PipelineHandle:
    """Offload `model` in place so its weights take at most `gpu_memory` on `device`; return the handle.

    For inference: the model may come as transformers builds it (training mode, parameters requiring
    gradients); offload puts it in eval mode and turns gradients off, and `restore()` puts both back.
    While offloaded, `train()`, `requires_grad_(True)` and autograd raise InferenceOnlyError;
    `state_dict()` and `parameters()` give the true weights; `deepcopy` and pickling refuse.

    gpu_memory: bytes (int) or a string like "6GiB" / "500MB": resident weights plus staging slots.
        Activations and KV caches are not counted: "auto" (the default) is the GPU's free memory now
        minus max(2 GiB, 10% of its memory) for them (a model already on that GPU counts as used: give a
        size for it, or move it to the CPU first; the CPU backend needs a size). Or an `OffloadConfig`
        holding every argument below (then give none of them):
        `ws.offload(model, ws.OffloadConfig("6GiB", compress=False))`. Every argument is validated
        once, by `OffloadConfig`.
    device: "cuda" (default when available) or "cpu" (the synchronous backend: same schedule, no
        streams; used for testing and CPU-only machines).
    pin_memory: page-lock the host arena (fast async copies, CUDA graphs). False streams from
        pageable memory: about 9x slower, no CUDA graph capture.
    blocks: qualified names of the block lists to stream (e.g. ["model.layers"]); found automatically
        by default.
    strategy: "auto" (default: what the cost model predicts fastest), "stream" (copy blocks into
        staging slots ahead of use) or "uva" (kernels read blocks in place from pinned host memory,
        no staging memory).
    tokens: tokens per forward to plan for (1 = batch-1 decode; 2048 for such a prefill).
    profile: the machine profile the planner costs placements with (`weightstream.MachineProfile`).
        Default: this GPU's cached profile, measured once (about ten seconds) when absent; the reference
        H200 profile without CUDA. Pass one (e.g. `weightstream.REFERENCE_PROFILE`) and the placement
        depends on the arguments alone, the same on every machine.
    placement: use this placement instead of planning one (`plan.placement_of` makes one from the
        model's cost, `prepare(...).cost`): how tests and tools force the case they need.
    compress: stream bf16/fp16 groups losslessly compressed (`codec.py`, about 0.71 of the bytes for
        Hugging Face-initialized bf16 weights) and decode them on the GPU into the slots: True, False
        or "auto" (the default: compressed wherever the planner predicts it faster, which on the H200
        held for every placement measured, LLMs and a Flux transformer (docs/compression.md); never
        on the CPU backend, and
        never for tensor subclasses, whose groups stream raw). False forces raw groups.
        Outputs stay bit-identical; landing buffers for the compressed bytes count in `gpu_memory`.
    check: after every wait and before every release, compare the block's staging slot with its
        group's true bytes and every streamed tensor's version counter, and raise naming the block and
        the tensor where something wrote streamed memory (slow: a host sync and a copy per block; not
        inside CUDA graph captures). None (default): on where the environment variable
        WEIGHTSTREAM_CHECK is set to anything but "" or "0".
    keep_resident: qualified names of parameters or buffers (as `model.state_dict()` names them) to
        keep on the device, counted in `gpu_memory`: state the model writes (a KV cache in buffers),
        so it is resident from the start, also for a model compiled before its first forward.
    expert_cache: for a mixture of experts whose routed experts are read in place, let the planner
        spend budget it leaves on a GPU expert cache per layer (slots holding the most frequently
        routed experts; docs/architecture.md) where its cost model predicts it
        faster (True, the default); False: no cache. `handle.stats` reports `cache_bytes` and, while
        `handle.count_experts()` is on, `expert_hit_rate`.
    routing_skew: the expert popularity the cache is planned for: tokens draw their experts from a
        Zipf(routing_skew) law (0: uniform; trained MoE routers are skewed: a cache of the most
        popular experts then serves more than its share of the reads), so the planner may trade
        resident blocks for cache slots, at decode too. None (default): uniform routing, where a
        slot serves only its share and the cache pays at prefill and large batches only. At decode the
        cache pays from CUDA graphs; eagerly its launches cost more than it saves (a warning says so).
    expert_copies: for a mixture of experts whose routed experts the planner reads in place, copy them
        instead: before each such layer's experts run, the host reads the routing (one synchronization
        per layer) and the copy engine copies the routed experts into a work buffer on the GPU, at the
        link's copy rate whatever their layout (GPT-OSS stores experts [experts, in, out], which a GEMM
        reads in place at about 0.45 of the link on an H100). Eager and `torch.compile` forwards; a CUDA
        graph capture is refused. No expert cache is planned with it. Default False.

    A tensor a block writes in its forward (a buffer it updates in place) is state, not a weight: it
    stays resident from that forward on, counted in `gpu_memory` (a warning names it; BudgetError where
    the budget cannot hold it). A streamed weight written in place from outside its block's forward
    (`w.mul_(s)` after offload) raises OffloadStateError at the next forward: edit weights inside
    `with handle.edit():` (docs/exactness.md).

    A diffusers pipeline is offloaded as a whole (`pipeline.offload_pipeline`, a `PipelineHandle`):
    device, pin_memory, strategy, compress and profile apply to every component; blocks, tokens,
    placement and keep_resident name one model's and are refused (`offload_pipeline(tokens=...,
    calls=...)` takes tokens per component), as are expert_copies and routing_skew, which the split
    over components does not plan.
    """
    config = config_of(gpu_memory, device=device, pin_memory=pin_memory, blocks=blocks, strategy=strategy,
                       tokens=tokens, profile=profile, placement=placement, compress=compress, check=check,
                       keep_resident=keep_resident, expert_cache=expert_cache, routing_skew=routing_skew,
                       expert_copies=expert_copies)
    if is_pipeline(model):  # a diffusers pipeline: one budget over its components (pipeline.py)
        refuse_per_model_options(config, "offload(pipeline) plans every component itself")
        return offload_pipeline(model, config)
    return offload_module(model, config)
