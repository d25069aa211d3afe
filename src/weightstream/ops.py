"""The two custom ops that carry the streaming schedule through a model's forward.

Why custom ops: under torch.compile the schedule must be opaque to the compiler (it cannot trace
stream and event calls) and must stay in place relative to the block's compute. Each op takes the
block's hidden state and returns a copy of it, so everything in the block depends on `wait` and
`release` depends on everything in the block: the compiler cannot move weight reads across them.
Declaring the streamed WEIGHTS as mutated instead gives wrong outputs (functionalization clones the
aliased slot views) and breaks CUDA-graph capture (measured on an H200: docs/architecture.md, "The
schedule"). The ops only enqueue GPU work (event waits and async copies), so a CUDA graph captures the
whole schedule and replays it alone. Their autograd rule, registered in guards.py, refuses: an
offloaded model is for inference only.

Engines are found by an integer id, so two offloaded models in one process stay independent.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Protocol

import torch

from .errors import OffloadStateError


class _Engine(Protocol):
    def wait(self, group: int) -> None: ...
    def release(self, group: int) -> None: ...


# Weak: a model dropped without restore() frees its arena and slots like any other object.
_ENGINES: weakref.WeakValueDictionary[int, _Engine] = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def register(engine: _Engine) -> int:
    """Make `engine` reachable from the ops (weakly); returns its id."""
    engine_id = next(_IDS)
    _ENGINES[engine_id] = engine
    return engine_id


def unregister(engine_id: int) -> None:
    """Forget an engine (after restore)."""
    _ENGINES.pop(engine_id, None)


def _engine(engine_id: int) -> _Engine:
    try:
        return _ENGINES[engine_id]
    except KeyError:
        raise OffloadStateError(
            f"weightstream engine {engine_id} is gone (handle.restore() was called, or the offloaded "
            "model was deleted): this compiled or captured forward still refers to it; compile or "
            "capture the model again"
        ) from None


@torch.library.custom_op("weightstream::wait", mutates_args=())
def wait(hidden: torch.Tensor, engine_id: int, group: int) -> torch.Tensor:
    """Before block `group`: make its weights ready in their slot; returns a copy of `hidden`."""
    _engine(engine_id).wait(group)
    return hidden.clone()


@wait.register_fake
def _wait_fake(hidden: torch.Tensor, engine_id: int, group: int) -> torch.Tensor:
    return torch.empty_like(hidden)


@torch.library.custom_op("weightstream::release", mutates_args=())
def release(hidden: torch.Tensor, engine_id: int, group: int) -> torch.Tensor:
    """After block `group`: free its slot and start the next copy into it; returns a copy of `hidden`."""
    _engine(engine_id).release(group)
    return hidden.clone()


@release.register_fake
def _release_fake(hidden: torch.Tensor, engine_id: int, group: int) -> torch.Tensor:
    return torch.empty_like(hidden)
