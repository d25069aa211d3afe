"""The two custom ops that carry the streaming schedule through a model's forward.

Why custom ops: under torch.compile the schedule must be opaque to the compiler (it cannot trace
stream and event calls) and must stay in place relative to the block's compute. `wait` takes every
tensor the block is called with and returns a copy of each, which the block then computes from;
`release` takes every tensor the block returns and returns copies. So everything the block computes
from its inputs depends on `wait`, and `release` depends on everything it returns: the compiler cannot
move a weight read out of the window, whichever input or output the read is on (a diffusion block
reads weights on its text stream and its time embedding too, and returns two streams). Declaring the
streamed WEIGHTS as mutated instead gives wrong outputs (functionalization clones the aliased slot
views) and breaks CUDA-graph capture (measured on the H200; see docs/exactness.md). The ops only
enqueue GPU work (event waits and async copies), so a CUDA graph captures the whole schedule. Their autograd
rule, registered in guards.py, refuses: an offloaded model is for inference only.

Engines are found by an integer id, so two offloaded models in one process stay independent.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Protocol

import torch

from ..errors import InferenceOnlyError, OffloadStateError

INFERENCE_ONLY = (
    "an offloaded model is for inference only: its streamed weights are views of staging buffers that "
    "the next group's copy overwrites, so {what} cannot work. Run under torch.no_grad() or "
    "torch.inference_mode() with gradients off, or call handle.restore() to get a trainable model back"
)


class _Engine(Protocol):
    def wait(self, group: int) -> None: ...
    def release(self, group: int) -> None: ...
    def unalias(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]: ...
    def abort(self) -> None: ...
    def on_graph_event(self, synchronize: bool = False) -> None: ...


_ENGINE_METHODS = tuple(name for name, value in vars(_Engine).items()
                        if callable(value) and not name.startswith("_"))
# Weak: a model dropped without restore() frees its arena and slots like any other object.
_ENGINES: weakref.WeakValueDictionary[int, _Engine] = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def register(engine: _Engine) -> int:
    """Make `engine` reachable from the ops (weakly); returns its id. An engine lacking one of
    `_Engine`'s methods is refused here, not at its first forward."""
    missing = [name for name in _ENGINE_METHODS if not callable(getattr(engine, name, None))]
    if missing:
        raise TypeError(f"weightstream: {type(engine).__name__} is not an engine: it lacks "
                        f"{', '.join(missing)}")
    engine_id = next(_IDS)
    _ENGINES[engine_id] = engine
    return engine_id


def unregister(engine_id: int) -> None:
    """Forget an engine (after restore)."""
    _ENGINES.pop(engine_id, None)


def engines() -> list[_Engine]:
    """Every live engine (for `replay.notify`)."""
    return list(_ENGINES.values())


def _engine(engine_id: int) -> _Engine:
    try:
        return _ENGINES[engine_id]
    except KeyError:
        raise OffloadStateError(
            f"weightstream engine {engine_id} is gone (handle.restore() was called, or the offloaded "
            "model was deleted): this compiled or captured forward still refers to it; compile or "
            "capture the model again"
        ) from None


def abort(engine_id: int) -> None:
    """A block of this engine raised between its wait and its release (eager only): let go of it."""
    engine = _ENGINES.get(engine_id)
    if engine is not None:
        engine.abort()


def eager(op, tensors: list[torch.Tensor], engine_id: int, group: int) -> list[torch.Tensor]:
    """The op `wait` or `release` (`op`) run straight on the engine, for an eager forward outside any
    tracing (`streamed.py` decides): the same schedule calls, without the custom op's dispatch and
    without copying every tensor a block takes and returns. Those copies exist for torch.compile (a
    custom op may not return its inputs); in eager they cost a device copy per tensor per block (7 per
    Flux block, 1.5 ms of a 197 ms step on the H200) and host time. Only a tensor that shares memory
    with the engine's staging slots is copied (`unalias`), before the release that lets the next copy
    overwrite the slot. Autograd is refused as the op's autograd rule refuses it (guards.py): where an
    input or output requires grad under grad mode, after the release (so the engine is free again)."""
    engine = _engine(engine_id)
    if op is wait:
        _refuse_autograd(tensors)  # before the wait takes the engine: nothing to let go of
        engine.wait(group)
        return engine.unalias(tensors)
    tensors = engine.unalias(tensors)
    engine.release(group)
    _refuse_autograd(tensors)
    return tensors


def _refuse_autograd(tensors: list[torch.Tensor]) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        refuse_autograd()


@torch.library.custom_op("weightstream::wait", mutates_args=())
def wait(tensors: list[torch.Tensor], engine_id: int, group: int) -> list[torch.Tensor]:
    """Before block `group`: make its weights ready in their slot; returns a copy of each of the
    block's input tensors."""
    _engine(engine_id).wait(group)
    return [t.clone() for t in tensors]


@wait.register_fake
def _wait_fake(tensors: list[torch.Tensor], engine_id: int, group: int) -> list[torch.Tensor]:
    return [torch.empty_like(t) for t in tensors]


@torch.library.custom_op("weightstream::release", mutates_args=())
def release(tensors: list[torch.Tensor], engine_id: int, group: int) -> list[torch.Tensor]:
    """After block `group`: free its slot and start the next copy into it; returns a copy of each of
    the block's output tensors, made before the release (an output may be a view of the slot)."""
    engine = _engine(engine_id)
    copies = [t.clone() for t in tensors]
    engine.release(group)
    return copies


@release.register_fake
def _release_fake(tensors: list[torch.Tensor], engine_id: int, group: int) -> list[torch.Tensor]:
    return [torch.empty_like(t) for t in tensors]


def refuse_autograd() -> None:
    """Raise the error for autograd through streamed blocks: the ops' autograd rule and the eager
    schedule calls (`ops.eager`) raise the same."""
    raise InferenceOnlyError(INFERENCE_ONLY.format(what="autograd through streamed blocks"))


def _no_autograd(ctx, inputs, output) -> None:
    refuse_autograd()


def _unreachable_backward(ctx, grad):  # setup_context always raises first
    raise InferenceOnlyError(INFERENCE_ONLY.format(what="backward()"))


for _op in (wait, release):
    _op.register_autograd(_unreachable_backward, setup_context=_no_autograd)
