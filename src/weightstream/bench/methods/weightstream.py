"""weightstream's own strategies as bench methods: `ws-stream`, `ws-uva`, `ws-auto`, each
`offload(model, gpu_memory=budget, strategy=..., tokens=phase tokens)`.

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
    return f"{p.kind}: {len(p.streamed)} streamed{part} / {p.n_slots} slots, {len(p.uva)} zero copy"


def prediction(handle: OffloadHandle) -> dict | None:
    """The planner's predicted ms per forward and what bounds it, or None when it made none."""
    pred = handle.placement.prediction
    return None if pred is None else {"ms": pred.ms, "bound": pred.bound}


def ws_prepare(strategy: str, **options) -> Prepare:
    """A prepare that offloads with `strategy` (and any further `offload` keyword `options`), planned
    for the phase's tokens; undo restores every tensor to where the model was."""

    def prepare(model: nn.Module, budget: int | None, tokens: int, device: torch.device):
        home, before = home_device(model), allocated(device)
        handle = offload(model, gpu_memory=budget, device=device, strategy=strategy, tokens=tokens, **options)
        stats = handle.stats
        info = {"stats": asdict(stats), "placement": placement_text(handle), "prediction": prediction(handle),
                "allocated_before_bytes": before, "allocated_after_bytes": allocated(device),
                "link_bytes": stats.streamed_bytes + stats.uva_bytes}

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
    Method("ws-auto", ws_prepare("auto"), MODES, "weightstream, the planner's choice", gives_reference=True),
)
