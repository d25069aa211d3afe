"""`draft="self"`: the model drafts for itself from what is already on the GPU plus low-bit copies of
the blocks it keeps off the GPU, so a draft step moves no byte over the link.

The draft is a second module tree over the model's own objects. Every module on the path from the
model to a block kept off the GPU (streamed or zero copy) is a shell: a new object of the module's own
class sharing its attributes, submodules, parameters and buffers; each such block is replaced by a
draft block, built the same way down to its leaves, in which every weight of two or more dimensions (a
Linear's weight, GPT-2's Conv1D, a fused expert tensor) is a symmetric low-bit copy read through
`QuantizedWeight` (dequantize, then the module's own matmul: `quantize.py`; a Linear over one token
on CUDA runs a low-bit matmul instead: `draft_linear.py`), and every other tensor is the model's own
where it is resident and a copy on the device where it is not. Everything else (embeddings, resident
blocks, the final norm, the head) is the model's own module, shared, not copied.
The draft blocks have their blocks' own classes, not the streamed subclasses, so a draft forward never
runs the schedule ops: no wait, no release, no copy.

KV cache: the draft writes into the model's own `TreeCache` (SubSpec shares it too). The committed
positions hold the model's keys and values, which the draft only reads; the draft writes only the
current tree's slots, [P, P + tree tokens), and the verify forward overwrites every one of those before
anything reads them, so the model's cache after a pass is what it would be with any other draft. The
draft therefore has no cache of its own (0 bytes) and attends to the model's exact prefix.
"""

from __future__ import annotations

import types
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from ..errors import ArgumentError
from ..handle import handle_of
from ..placement.blocks import find_blocks
from .cache import TreeCache
from .draft_linear import use_low_bit_forward
from .draft_model import grow_beam
from .quantize import BITS, LEAST_GROUP, quantize_parameter, quantized_bytes
from .tree import Tree, TreeShape, causal_mask
from .verify import TreeForward


class SelfDraft:
    """The model's own low-bit draft (module docstring). bits: 4 (default) or 8; group: input columns
    per scale, at least 64 (default 128), even; blocks: the qualified names of the blocks to draft with
    low-bit copies (default: those an offloaded model keeps off the GPU, every block of a resident
    one). The draft is built at its first `generate` and kept by this object for later calls on the
    same offloaded model; `draft="self"` builds one per call."""

    def __init__(self, bits: int = 4, group: int = 128, blocks: Sequence[str] | None = None) -> None:
        if bits not in BITS or isinstance(bits, bool):
            raise ArgumentError(f"SelfDraft(bits={bits!r}): give bits=4 (the default) or bits=8")
        if not isinstance(group, int) or isinstance(group, bool) or group < LEAST_GROUP or group % 2:
            raise ArgumentError(
                f"SelfDraft(group={group!r}): give an even number of input columns per scale, at least "
                f"{LEAST_GROUP} (default 128; smaller groups ride a 4-bit checkpoint's own grid)")
        if blocks is not None and (isinstance(blocks, str) or not all(isinstance(b, str) for b in blocks)):
            raise ArgumentError(f"SelfDraft(blocks={blocks!r}): give a list of block names such as "
                                "['model.layers.3'], or None for the blocks kept off the GPU")
        self.bits, self.group = bits, group
        self.blocks = tuple(blocks) if blocks is not None else None
        self.name = f"self int{bits} g{group}"
        self.model: nn.Module | None = None  # the draft module, once built
        self.forward: TreeForward | None = None
        self._built_for: tuple[int, int] | None = None
        self._bytes = 0

    # --- what the draft is made of ------------------------------------------------------------------
    def block_names(self, model: nn.Module) -> list[str]:
        """The blocks drafted with low-bit copies: `blocks`, or those `model` keeps off the GPU (every
        block of a resident model). ArgumentError for a name that is not one of the model's blocks."""
        known = [b.name for b in find_blocks(model)]
        if self.blocks is not None:
            unknown = [name for name in self.blocks if name not in known]
            if unknown:
                raise ArgumentError(f"SelfDraft(blocks=...): {unknown[0]!r} is not one of the model's "
                                    f"blocks ({', '.join(known[:3])}, ...): name blocks as find_blocks does")
            return list(self.blocks)
        handle = _handle(model)
        if handle is None:
            return known
        return [*handle.streamed_blocks, *handle.uva_blocks]

    def needed_bytes(self, model: nn.Module) -> int:
        """Bytes building the draft for `model` allocates on its device (0 where it is built already):
        the low-bit copies (integers and float32 scales) of the drafted blocks' weights of two or more
        dimensions, and copies of their other tensors that the model keeps off the GPU."""
        if self._built_for == _key(model):
            return 0
        guards = _guards(model)
        modules = dict(model.named_modules())
        return sum(_block_bytes(modules[name], self.bits, self.group, lambda t: _off_gpu(guards, t))
                   for name in self.block_names(model))

    def planned_bytes(self, model: nn.Module, off_gpu: Sequence[str],
                      blocks: Sequence[str] | None = None) -> int:
        """Bytes the draft would take on the device were `model` (resident, or built on the meta device:
        shapes are enough) offloaded with the blocks named `off_gpu` kept off the GPU: the low-bit copies
        of the drafted blocks (`blocks` of this SelfDraft, else `off_gpu`) and copies of every other
        tensor of those of them off the GPU (an upper bound where only part of a block leaves the GPU).
        blocks: the block lists the offload streams (as `offload(blocks=...)`; None: found)."""
        known = {b.name: b.module for b in find_blocks(model, list(blocks) if blocks is not None else None)}
        off = set(off_gpu)
        drafted = list(self.blocks) if self.blocks is not None else [n for n in known if n in off]
        modules = dict(model.named_modules())
        return sum(_block_bytes(known.get(name) or modules[name], self.bits, self.group,
                                lambda t, off_block=name in off: off_block) for name in drafted)

    def device_bytes(self) -> int:
        """Bytes the built draft holds on the device (its KV cache is the model's: 0 bytes of its own)."""
        return self._bytes

    def build(self, model: nn.Module) -> nn.Module:
        """The draft module of `model` (module docstring), built once per offloaded model."""
        if self._built_for == _key(model):
            return self.model
        self.model = self.forward = None
        guards = _guards(model)
        device = model.get_input_embeddings().weight.device
        shells: dict[str, nn.Module] = {"": _shell(model)}
        stored = 0
        with torch.no_grad():
            for name in self.block_names(model):
                parent_name, _, leaf = name.rpartition(".")
                parent = _shell_path(model, shells, parent_name)
                block, size = _draft_block(parent._modules[leaf], guards, device, self.bits, self.group)
                parent._modules[leaf] = block  # past __setattr__: no registration hook sees the draft
                stored += size
        self.model, self._built_for, self._bytes = shells[""], _key(model), stored
        return self.model

    # --- the Draft protocol -------------------------------------------------------------------------
    def bind(self, model: nn.Module, cache: TreeCache, compile: bool | str = False) -> None:
        """Draft for `model` into its generation's `cache` (shared: module docstring)."""
        draft = self.build(model)
        device = model.get_input_embeddings().weight.device
        self.forward = TreeForward(draft, cache, device, _dtype(model), compile)

    def begin(self, prompt: torch.Tensor, length: int, device: torch.device) -> None:
        """Nothing to fill: the model's prefill wrote the prompt's keys and values into the shared cache."""

    def propose(self, context: torch.Tensor, shape: TreeShape) -> Tree:
        """One forward of the root alone (the committed tokens are the model's, in the cache), then one
        of `width` tokens per level (`grow_beam`)."""
        if shape.depth == 0:
            return grow_beam(self.forward, None, context, shape)
        start = torch.tensor([context.numel() - 1])
        mask = causal_mask(int(start), 1, self.forward.cache.length)
        logits = self.forward.run(context[-1:], start, start, mask)
        return grow_beam(self.forward, logits, context, shape)

    def accept(self, path: list[int], start: int) -> None:
        """Nothing to move: the loop moved the accepted path in the shared cache."""


def _handle(model: nn.Module):
    try:
        return handle_of(model)
    except Exception:  # a resident model
        return None


def _guards(model: nn.Module):
    handle = _handle(model)
    return handle.engine.guards if handle is not None else None


def _key(model: nn.Module) -> tuple[int, int]:
    """What a built draft belongs to: the model, and the offload whose weights it copied."""
    handle = _handle(model)
    return id(model), id(handle.engine) if handle is not None else 0


def _dtype(model: nn.Module) -> torch.dtype:
    return model.get_input_embeddings().weight.dtype


def _off_gpu(guards, tensor: torch.Tensor) -> bool:
    """Whether the model keeps `tensor` off the GPU (streamed or zero copy); a resident model keeps none."""
    return guards is not None and guards.true_value(tensor) is not tensor


def _own_tensors(module: nn.Module):
    """(tensor, is a parameter) of the live parameters and buffers of `module` and its submodules (the
    tensors its forward reads, not the true-weight copies an offloaded module's `parameters()` gives)."""
    for sub in nn.Module.modules(module):
        yield from ((p, True) for p in sub._parameters.values() if p is not None)
        yield from ((b, False) for b in sub._buffers.values() if b is not None)


def _block_bytes(block: nn.Module, bits: int, group: int, off_gpu) -> int:
    """Bytes drafting `block` stores on the device: a low-bit copy of each of its parameters of two or
    more dimensions, and a copy of each other tensor for which `off_gpu(tensor)` holds (a tensor shared
    within the block counted once)."""
    seen, total = set(), 0
    for tensor, parameter in _own_tensors(block):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if parameter and tensor.dim() >= 2:
            total += quantized_bytes(tensor.shape, bits, group)
        elif off_gpu(tensor):
            total += tensor.numel() * tensor.element_size()
    return total


def _shell(module: nn.Module) -> nn.Module:
    """A new object of `module`'s own class (not a streamed subclass) sharing its attributes,
    submodules, parameters and buffers, without the instance patches and state-dict hooks an offload
    put on it."""
    cls = type(module)
    if "_ws_engine_id" in module.__dict__:  # a streamed block: its class is a subclass of its own
        cls = cls.__mro__[1]
    shell = cls.__new__(cls)
    state = {key: value for key, value in module.__dict__.items()
             if not key.startswith(("_ws", "_weightstream")) and key != "_apply"
             and not (isinstance(value, types.MethodType) and value.__self__ is module)}
    for key in ("_modules", "_parameters", "_buffers"):
        state[key] = dict(state[key])
    for key in ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                "_load_state_dict_post_hooks"):
        if key in state:
            state[key] = OrderedDict()
    shell.__dict__.update(state)
    return shell


def _shell_path(model: nn.Module, shells: dict[str, nn.Module], name: str) -> nn.Module:
    """The shell of the module `name` (a dotted path from the model), with a shell of every module
    above it put in its parent's place."""
    if name in shells:
        return shells[name]
    parent_name, _, leaf = name.rpartition(".")
    parent = _shell_path(model, shells, parent_name)
    shell = shells[name] = _shell(parent._modules[leaf])
    parent._modules[leaf] = shell
    return shell


def _draft_block(block: nn.Module, guards, device: torch.device, bits: int,
                 group: int) -> tuple[nn.Module, int]:
    """A draft copy of `block` (module docstring) and the bytes it stored on `device`."""
    made: dict[int, nn.Module] = {}
    tensors: dict[int, torch.Tensor] = {}
    stored = 0

    def clone(module: nn.Module) -> nn.Module:
        nonlocal stored
        if id(module) in made:
            return made[id(module)]
        new = made[id(module)] = _shell(module)
        for name, child in module._modules.items():
            if child is not None:
                new._modules[name] = clone(child)
        for kind in ("_buffers", "_parameters"):
            for name, tensor in getattr(module, kind).items():
                if tensor is None or id(tensor) in tensors:
                    getattr(new, kind)[name] = tensors.get(id(tensor)) if tensor is not None else None
                    continue
                quantized = kind == "_parameters" and tensor.dim() >= 2
                if quantized or _off_gpu(guards, tensor):
                    value = guards.true_value(tensor) if guards is not None else tensor
                    value = value.detach().to(device, copy=True)
                    if kind == "_parameters":
                        value = nn.Parameter(value, requires_grad=False)
                    stored += 0 if quantized else value.numel() * value.element_size()
                else:
                    value = tensor
                tensors[id(tensor)] = value
                getattr(new, kind)[name] = value
                if quantized:
                    stored += quantize_parameter(new, name, bits, group)
                    if name == "weight":
                        use_low_bit_forward(new)
        return new

    return clone(block), stored
