"""How an offloaded model's modules are changed: each streamed block gets a subclass whose forward
passes every tensor it takes and returns through the schedule ops (`ops.py`), and every module gets
an `_apply` that refuses `.to()` / `.cuda()` / `.half()` (they would break the streaming views).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.utils._pytree as pytree
from torch import nn

from . import ops
from .errors import OffloadStateError, WeightstreamError


def _tensor_leaves(tree) -> tuple[list, object, list[int]]:
    """Flatten `tree` (tensors nested in tuples, lists, dicts, dataclasses registered with pytree);
    returns the leaves, the structure and the positions of the tensor leaves."""
    leaves, spec = pytree.tree_flatten(tree)
    return leaves, spec, [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]


# Whether an eager forward calls the engine straight (`ops.eager`); False sends it through the custom
# ops and their copies as a compiled forward does (benchmarks/ab_eager_ops.py times one against the other)
EAGER_DIRECT = True


def _traced(tensors: list[torch.Tensor]) -> bool:
    """Whether this call is being traced (torch.compile, export, make_fx, fake tensors) rather than
    run eagerly, or EAGER_DIRECT is off: then the schedule goes through the custom ops."""
    return (not EAGER_DIRECT or torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or any(type(t) is not torch.Tensor for t in tensors))


def _through(op, tree, engine_id: int, group: int):
    """`tree` with every tensor in it replaced by what `op` returns for it (one call for all). Run
    eagerly, the engine is called straight (`ops.eager`: no op dispatch, no copies)."""
    leaves, spec, where = _tensor_leaves(tree)
    if not where:
        return tree, False
    tensors = [leaves[i] for i in where]
    if _traced(tensors):
        new = op(tensors, engine_id, group)
    else:
        new = ops.eager(op, tensors, engine_id, group)
    for i, t in zip(where, new, strict=True):
        leaves[i] = t
    return pytree.tree_unflatten(leaves, spec), True


def _blocked_apply(self, fn, *args, **kwargs):
    raise OffloadStateError(
        f"{type(self).__name__} is offloaded by weightstream: .to()/.cuda()/.half() would break the "
        "streaming views. Call handle.restore() first, then move or cast the model."
    )


_STREAMED_CLASSES: dict[type, type] = {}


def _streamed_forward(base_forward, name: str):
    """The forward of a streamed block: wait for its group, run `base_forward`, release the slot.
    Every tensor the block is called with goes through the wait and every tensor it returns through
    the release, so no weight read can leave the window (ops.py says why)."""

    def forward(self, *args, **kwargs):
        engine_id, group = self._ws_engine_id, self._ws_group
        (args, kwargs), found = _through(ops.wait, (args, kwargs), engine_id, group)
        if not found:
            raise WeightstreamError(
                f"{name} was called with no tensor argument: weightstream orders its copies through "
                "the tensors a block is called with"
            )
        if torch.compiler.is_compiling():
            output = base_forward(self, *args, **kwargs)
        else:
            try:
                output = base_forward(self, *args, **kwargs)
            except BaseException:
                ops.abort(engine_id)
                raise
        output, found = _through(ops.release, output, engine_id, group)
        if not found:
            raise WeightstreamError(
                f"{name} returned no tensor: weightstream orders its copies through the tensors a "
                "block returns"
            )
        return output

    return forward


def _streamed_class(base: type) -> type:
    """A subclass of `base` whose forward runs the schedule ops around the original forward.

    A new class rather than hooks: torch.compile guards on a submodule's type but not on its hooks,
    so a graph compiled for the resident model would otherwise be reused for the offloaded one. The
    original forward is held as a plain function: a class marked `allow_in_graph` (diffusers marks its
    transformer blocks so) is opaque to dynamo, and calling `base.forward` through it breaks the graph.
    """
    if base not in _STREAMED_CLASSES:
        forward = _streamed_forward(base.forward, base.__name__)
        _STREAMED_CLASSES[base] = type(f"Streamed{base.__name__}", (base,), {"forward": forward})
    return _STREAMED_CLASSES[base]


if TYPE_CHECKING:
    from .offload import OffloadHandle


def _install_schedule(handle: OffloadHandle, blocks: list[nn.Module]) -> None:
    for group, index in enumerate(handle.placement.streamed):
        block = blocks[index]
        block._ws_engine_id, block._ws_group = handle.engine_id, group
        block.__class__ = _streamed_class(type(block))
        handle._streamed_modules.append(block)

