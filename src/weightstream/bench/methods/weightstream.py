"""weightstream's own strategies as bench methods: `ws-stream`, `ws-uva`, `ws-auto`, each
`offload(model, gpu_memory=budget, strategy=..., tokens=phase tokens)`, and `ws-auto-compress`, the
same as `ws-auto` with `compress=True` (groups cross the link losslessly compressed wherever a
compressed placement fits the budget). Every setup records the streamed groups' `wire_bytes`,
`wire_raw_bytes` and `wire_ratio`, and `link_bytes` counts the wire bytes (what really crosses); on a
GPU, a setup with compressed groups also records `decoder_GBps`, the decoder's rate on one of them.
`ws-stream-raw` and `ws-stream-compress` (every group through the slots, raw or compressed: the
comparison of formerly `benchmarks/bench_codec.py`) run only when named in `--methods`.

The setup records the placement and the planner's prediction next to the measurement, so a run over
budgets is also the planner-against-measurement sweep (formerly `benchmarks/bench_plan.py`). A variant
(e.g. lossless compression) is one more `Method` line with its own `ws_prepare(..., **options)`.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
from torch import nn

from ...offload import OffloadHandle, offload
from ..memory import allocated, home_device
from ..schema import MODES
from .base import Method, Prepare


def placement_text(handle: OffloadHandle) -> str:
    """One line: the strategy, streamed blocks (and part) / slots, zero-copy blocks."""
    p = handle.placement
    part = f" (each block's {p.part} largest tensors)" if p.part else ""
    experts = f" ({len(p.uva_experts)} of them only their routed experts)" if p.uva_experts else ""
    if p.expert_cache:
        experts += f", an expert cache of {p.expert_slots} slots in {len(p.expert_cache)} blocks"
    if p.expert_copies:
        coded = " (held compressed)" if p.copy_landing_bytes else ""
        experts += f", routed experts copied by the copy engine in {len(p.expert_copies)} blocks{coded}"
    return f"{p.kind}: {len(p.streamed)} streamed{part} / {p.n_slots} slots, {len(p.uva)} zero copy{experts}"


def prediction(handle: OffloadHandle) -> dict | None:
    """The planner's predicted ms per forward and what bounds it, or None when it made none: `ms` for a
    forward entered with nothing staged (a CUDA graph replay), `warm_ms` for one in a loop of them
    (eager and compiled, timed back to back)."""
    pred = handle.placement.prediction
    return None if pred is None else {"ms": pred.ms, "warm_ms": pred.again_ms, "bound": pred.bound}


def link_bytes(stats) -> int:
    """Bytes that cross the host->GPU link per forward: the streamed and zero-copy bytes, with each
    compressed group's blob in place of its raw bytes (the same figure as before for raw groups)."""
    return stats.streamed_bytes + stats.uva_bytes - (stats.wire_raw_bytes - stats.wire_bytes)


def decoder_rate(handle: OffloadHandle, device: torch.device, calls: int = 20) -> float | None:
    """GB/s of decoded bytes of the GPU decoder on one of the handle's compressed groups (standalone
    launches, each from an idle GPU, median); None on a CPU or without a compressed group."""
    import statistics

    enc = next((e for e in handle.engine.wire if e is not None), None)
    if enc is None or device.type != "cuda":
        return None
    from ...placement.timing import time_calls
    from ...wire import triton_decoder

    blob = enc.blob.to(device)
    out = torch.empty(enc.raw_bytes, dtype=torch.uint8, device=device)
    for _ in range(3):
        triton_decoder.decode(blob, out, enc.chunks)
    times, _ = time_calls(lambda: triton_decoder.decode(blob, out, enc.chunks), calls, device,
                          back_to_back=False)
    return enc.raw_bytes / (statistics.median(times) / 1e3) / 1e9


def ws_prepare(strategy: str, experts_apart: bool = True, **options) -> Prepare:
    """A prepare that offloads with `strategy` (and any further `offload` keyword `options`), planned
    for the phase's tokens; undo restores every tensor to where the model was. `experts_apart=False`:
    zero-copy blocks of a mixture of experts are read in place whole (`plan.plan`)."""

    def prepare(model: nn.Module, budget: int | None, tokens: int, device: torch.device):
        home, before = home_device(model), allocated(device)
        given = dict(options)
        if given.get("routing_skew") == "synthetic":  # the skew `--routing-skew` gave the model, if any
            given["routing_skew"] = getattr(model, "synthetic_routing_skew", None)
        if not experts_apart:
            from ...placement.prepare import prepare as plan_only

            given["placement"] = plan_only(model, budget, device, strategy=strategy, tokens=tokens,
                                           experts_apart=False, **options).placement
        handle = offload(model, gpu_memory=budget, device=device, strategy=strategy, tokens=tokens, **given)
        stats = handle.stats
        info = {"stats": asdict(stats), "placement": placement_text(handle), "prediction": prediction(handle),
                "allocated_before_bytes": before, "allocated_after_bytes": allocated(device),
                "link_bytes": link_bytes(stats), "wire_bytes": stats.wire_bytes,
                "wire_raw_bytes": stats.wire_raw_bytes, "wire_ratio": stats.wire_ratio}
        rate = decoder_rate(handle, device)
        if rate is not None:
            info["decoder_GBps"] = rate
        if "routing_skew" in given:  # what the planner was told (ws-auto-skew)
            info["routing_skew"] = given["routing_skew"]

        def undo() -> None:
            handle.restore(home)

        return info, undo

    extra = "".join(f", {k}={v!r}" for k, v in options.items())
    prepare.__doc__ = f"weightstream offload(strategy={strategy!r}{extra}), planned for the phase's tokens."
    return prepare


METHODS = (
    Method("ws-stream", ws_prepare("stream"), MODES, "weightstream, blocks streamed through staging slots",
           gives_reference=True),
    Method("ws-uva", ws_prepare("uva"), MODES, "weightstream, blocks read in place from pinned memory",
           gives_reference=True),
    Method("ws-auto", ws_prepare("auto"), MODES, "weightstream, the planner's choice (offload's defaults; "
           "compress='auto' since 2026-12-03: results recorded before streamed raw)", gives_reference=True),
    Method("ws-auto-raw", ws_prepare("auto", compress=False), MODES,
           "weightstream, the planner's choice with every group raw on the wire (compress=False)",
           gives_reference=True),
    Method("ws-auto-compress", ws_prepare("auto", compress=True), MODES,
           "weightstream, the planner's choice with groups losslessly compressed on the wire (compress=True)",
           gives_reference=True),
    Method("ws-auto-skew", ws_prepare("auto", routing_skew="synthetic"), MODES,
           "weightstream, the planner told the synthetic routing skew (--routing-skew S: it plans the GPU "
           "expert cache for Zipf(S) popularity; without it, the same as ws-auto)", gives_reference=True,
           in_default=False),
    Method("ws-auto-copies", ws_prepare("auto", expert_copies=True), ("eager", "compiled"),
           "weightstream, the planner's choice with routed experts copied by the copy engine once the host "
           "has read the routing (expert_copies=True; no CUDA graphs)", gives_reference=True,
           in_default=False),
    Method("ws-auto-copies-coded", ws_prepare("auto", expert_copies=True, compress=True),
           ("eager", "compiled"),
           "weightstream, the planner's choice with routed experts held compressed in host memory, copied "
           "by the copy engine once the host has read the routing and decoded on the GPU "
           "(expert_copies=True, compress=True; no CUDA graphs)", gives_reference=True, in_default=False),
    Method("ws-uva-whole-blocks", ws_prepare("uva", experts_apart=False), MODES,
           "weightstream, blocks read in place from pinned memory whole (a mixture of experts' dense "
           "tensors too, every token)", gives_reference=True, in_default=False),
    Method("ws-stream-raw", ws_prepare("stream", compress=False), MODES,
           "weightstream, blocks streamed through staging slots, every group raw on the wire "
           "(compress=False)",
           gives_reference=True, in_default=False),
    Method("ws-stream-compress", ws_prepare("stream", compress=True), MODES,
           "weightstream, blocks streamed through staging slots, losslessly compressed where a compressed "
           "placement fits (compress=True)", gives_reference=True, in_default=False),
)
