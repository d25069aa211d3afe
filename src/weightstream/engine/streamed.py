"""How an offloaded model's modules are changed: each streamed block gets a subclass whose forward
passes every tensor it takes and returns through the schedule ops (`ops.py`), and every module gets
an `_apply` that refuses `.to()` / `.cuda()` / `.half()` (they would break the streaming views).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.nn.modules.module import (  # the process-wide hooks nn.Module._call_impl runs too
    _global_forward_hooks,
    _global_forward_hooks_always_called,
    _global_forward_hooks_with_kwargs,
    _global_forward_pre_hooks,
)

from ..errors import OffloadStateError, WeightstreamError
from . import ops


def _tensors(node, out: list) -> None:
    """Append every tensor in `node` (nested in lists, tuples, dicts and the other containers pytree
    knows: dataclasses, named tuples, model outputs) to `out`, in the order `_refill` puts them back."""
    kind = type(node)
    if kind is list or kind is tuple:
        for item in node:
            _tensors(item, out)
    elif kind is dict:
        for item in node.values():
            _tensors(item, out)
    elif isinstance(node, torch.Tensor):
        out.append(node)
    else:
        out.extend(leaf for leaf in pytree.tree_leaves(node) if isinstance(leaf, torch.Tensor))


def _refill(node, new):
    """`node` with each of its tensors replaced by the next of iterator `new` (in `_tensors`' order).
    Plain lists and dicts are filled IN PLACE and returned themselves: a block may mutate a container it
    is called with (Wan's VAE blocks update a cache list and an index list), and that must reach its
    caller as in the resident model. Tuples and other containers are rebuilt."""
    kind = type(node)
    if kind is list:
        for i, item in enumerate(node):
            node[i] = _refill(item, new)
        return node
    if kind is dict:
        for key, item in node.items():
            node[key] = _refill(item, new)
        return node
    if kind is tuple:
        return tuple(_refill(item, new) for item in node)
    if isinstance(node, torch.Tensor):
        return next(new)
    leaves, spec = pytree.tree_flatten(node)
    if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return node
    return pytree.tree_unflatten([next(new) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves],
                                 spec)


# Whether an eager forward calls the engine straight (`ops.eager`); False sends it through the custom
# ops and their copies as a compiled forward does (docs/diagnostics.md: one timed against the other)
EAGER_DIRECT = True


def _traced(tensors: list[torch.Tensor]) -> bool:
    """Whether this call is being traced (torch.compile, export, make_fx, fake tensors) rather than
    run eagerly, or EAGER_DIRECT is off: then the schedule goes through the custom ops."""
    return (not EAGER_DIRECT or torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or any(type(t) is not torch.Tensor for t in tensors))


def _through(op, tree, engine_id: int, group: int):
    """`tree` with every tensor in it replaced by what `op` returns for it (one call for all), the
    caller's lists and dicts kept (`_refill`). Run eagerly, the engine is called straight (`ops.eager`:
    no op dispatch, no copies), and where it returns every tensor as it was, `tree` itself."""
    tensors: list[torch.Tensor] = []
    _tensors(tree, tensors)
    if not tensors:
        return tree, False
    if _traced(tensors):
        new = op(tensors, engine_id, group)
    else:
        new = ops.eager(op, tensors, engine_id, group)
        if all(a is b for a, b in zip(new, tensors, strict=True)):
            return tree, True
    if len(new) != len(tensors):
        raise AssertionError("weightstream: a schedule op returned a different number of tensors")
    return _refill(tree, iter(new)), True


def _blocked_apply(self, fn, *args, **kwargs):
    raise OffloadStateError(
        f"{type(self).__name__} is offloaded by weightstream: .to()/.cuda()/.half() would break the "
        "streaming views. Call handle.restore() first, then move or cast the model."
    )


_STREAMED_CLASSES: dict[type, type] = {}


def _window(self, name: str, args: tuple, kwargs: dict, body):
    """Run `body(args, kwargs)` between the wait for this block's group and its release: every tensor
    the block is called with goes through the wait and every tensor `body` returns through the release,
    so no weight read can leave the window (ops.py says why)."""
    engine_id, group = self._ws_engine_id, self._ws_group
    (args, kwargs), found = _through(ops.wait, (args, kwargs), engine_id, group)
    if not found:
        raise WeightstreamError(
            f"{name} was called with no tensor argument: weightstream orders its copies through "
            "the tensors a block is called with"
        )
    if torch.compiler.is_compiling():
        output = body(args, kwargs)
    else:
        try:
            output = body(args, kwargs)
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


def _streamed_forward(base_forward, name: str):
    """The forward of a streamed block: wait for its group, run `base_forward`, release the slot."""

    def forward(self, *args, **kwargs):
        return _window(self, name, args, kwargs, lambda a, k: base_forward(self, *a, **k))

    return forward


def _hooks(self) -> bool:
    """Whether forward hooks or pre-hooks would run around this module's forward (its own or global)."""
    return bool(self._forward_hooks or self._forward_pre_hooks or _global_forward_hooks
                or _global_forward_pre_hooks)


def _hooked(self, base_forward, args: tuple, kwargs: dict):
    """`base_forward` with the module's forward pre-hooks before it and forward hooks after it, as
    `nn.Module._call_impl` runs them (with or without kwargs, global ones first, `always_call` hooks
    also when the forward raises)."""
    for hook_id, hook in (*_global_forward_pre_hooks.items(), *self._forward_pre_hooks.items()):
        if hook_id in self._forward_pre_hooks_with_kwargs:
            got = hook(self, args, kwargs)
            if got is not None:
                if not (isinstance(got, tuple) and len(got) == 2):
                    raise RuntimeError("forward pre-hook must return None or a tuple of (new_args, "
                                       f"new_kwargs), but got {got}.")
                args, kwargs = got
        else:
            got = hook(self, args)
            if got is not None:
                args = got if isinstance(got, tuple) else (got,)
    hooks = (*_global_forward_hooks.items(), *self._forward_hooks.items())
    called = set()
    result = None
    try:
        result = base_forward(self, *args, **kwargs)
        for hook_id, hook in hooks:
            called.add(hook_id)
            if hook_id in self._forward_hooks_with_kwargs or hook_id in _global_forward_hooks_with_kwargs:
                got = hook(self, args, kwargs, result)
            else:
                got = hook(self, args, result)
            if got is not None:
                result = got
    except Exception:
        if torch.compiler.is_compiling():
            raise
        for hook_id, hook in hooks:  # as nn.Module._call_impl: always_call hooks run even so
            if hook_id in called or not (hook_id in self._forward_hooks_always_called
                                         or hook_id in _global_forward_hooks_always_called):
                continue
            try:
                if hook_id in self._forward_hooks_with_kwargs:
                    hook(self, args, kwargs, result)
                else:
                    hook(self, args, result)
            except Exception as e:
                warnings.warn("module forward hook with ``always_call=True`` raised an exception that was "
                              f"silenced as another error was raised in forward: {e}", stacklevel=2)
        raise
    return result


def _streamed_call(base_forward, name: str):
    """`_call_impl` of a streamed block: where forward hooks or pre-hooks are registered (on the block,
    before or after offload, or globally), they run inside the block's window, so a hook that reads the
    block's weights sees them, not whatever the staging slot holds outside the window. Without hooks,
    torch's own `_call_impl` (which calls the streamed forward)."""

    def _call_impl(self, *args, **kwargs):
        if not _hooks(self):
            return nn.Module._call_impl(self, *args, **kwargs)
        return _window(self, name, args, kwargs, lambda a, k: _hooked(self, base_forward, a, k))

    return _call_impl


def _streamed_class(base: type) -> type:
    """A subclass of `base` whose forward runs the schedule ops around the original forward.

    A new class rather than hooks: torch.compile guards on a submodule's type but not on its hooks,
    so a graph compiled for the resident model would otherwise be reused for the offloaded one. The
    original forward is held as a plain function: a class marked `allow_in_graph` (diffusers marks its
    transformer blocks so) is opaque to dynamo, and calling `base.forward` through it breaks the graph.
    """
    if base not in _STREAMED_CLASSES:
        forward = _streamed_forward(base.forward, base.__name__)
        call = _streamed_call(base.forward, base.__name__)
        _STREAMED_CLASSES[base] = type(f"Streamed{base.__name__}", (base,),
                                       {"forward": forward, "_call_impl": call})
    return _STREAMED_CLASSES[base]


if TYPE_CHECKING:
    from .engine import StreamEngine


def _install_schedule(engine: StreamEngine, blocks: list[nn.Module], installed: list[nn.Module]) -> None:
    """Give each streamed block of `blocks` (by the placement's indices) its streamed class, calling
    `engine` for its group; append them to `installed`."""
    for group, index in enumerate(engine.placement.streamed):
        block = blocks[index]
        block._ws_engine_id, block._ws_group = engine.engine_id, group
        block.__class__ = _streamed_class(type(block))
        installed.append(block)
