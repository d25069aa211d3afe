"""Everything a user does with an offloaded model besides calling it: the true weights, or a clear no.

A streamed tensor is a permanent view of a staging slot that several groups share, so between forwards
it holds whichever group was copied last. Without these guards `state_dict()` (and so `torch.save`,
`save_pretrained`), `parameters()` and `deepcopy` would hand out slot contents without a word.
So, on every module of an offloaded model:
- `state_dict()` gives each tensor kept off the GPU (streamed or zero copy) as its true bytes: a CPU
  view of its host arena region, or read from the checkpoint for a group on disk. Host tensors, not
  zero-copy device views: those would dangle once `restore()` unpins the arena, and the arena's
  memory itself lives as long as any view of it. `named_parameters()`/`parameters()`/
  `named_buffers()`/`buffers()` give the same in place of the slot views, except while torch.compile
  traces (the graph must read the slots);
- `copy.deepcopy`, pickling (`torch.save(model)`) refuse, and so does `load_state_dict` of a tensor kept
  off the GPU: they would copy or overwrite slots (a state dict of other tensors, LoRA adapters, loads);
- `train()` and `requires_grad_(True)` refuse, and so does autograd through the schedule ops (a weight
  saved for backward would be overwritten by the next group's copy): inference only.
`offload` turns gradients off and puts the model in eval mode itself; `restore` puts both back. All of
this is instance attributes and the ops' autograd rule: nothing on the forward path changes, so
torch.compile(fullgraph=True) and CUDA graphs see what they saw before.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from ..errors import InferenceOnlyError, OffloadStateError
from .ops import INFERENCE_ONLY

_LIVE: weakref.WeakSet = weakref.WeakSet()  # the guards of every offloaded model not yet restored


def held_by(tensor: torch.Tensor) -> str | None:
    """The class name of the offloaded (not yet restored) model that holds `tensor` itself, the very
    object, as a parameter or buffer; None where none does."""
    for guards in list(_LIVE):
        ref = guards.held.get(id(tensor))
        if ref is not None and ref() is tensor:
            return guards.model_name
    return None


class ModelGuards:
    """The guards of one offloaded model; `remove()` takes them all off again (from `restore`)."""

    def __init__(self, engine, model) -> None:
        self.engine = engine
        self.modules = list(model.modules())
        self.model_name = type(model).__name__
        # every tensor object the model holds (`held_by`: another model holding one is refused)
        self.held = {id(t): weakref.ref(t) for m in self.modules
                     for t in (*m._parameters.values(), *m._buffers.values()) if t is not None}
        _LIVE.add(self)
        self.training = [m.training for m in self.modules]
        self.grads = [p for p in model.parameters() if p.requires_grad]
        self._true = self._true_tensors()
        self._decoded: tuple[int | None, torch.Tensor | None] = (None, None)  # the last decoded group
        self._copies: list[tuple[weakref.ref, int, str]] = []  # copies handed out: (tensor, version, name)
        self._hooks = []
        for p in self.grads:
            p.requires_grad_(False)
        model.eval()
        sites = {}
        for entry, _, _ in self._off_gpu():
            for site in entry.sites:
                sites.setdefault(id(site.module), (site.module, []))[1].append((site.name, entry))
        for module, names in sites.values():
            self._hooks.append(module.register_state_dict_post_hook(self._state_dict_hook(names)))
        # before any: the tensors the model rebound since its last forward are what it holds now
        self._hooks.append(model.register_state_dict_pre_hook(lambda *args: self.engine.settle()))
        # the model's own hook runs after every submodule's: the decoded group is not kept afterwards
        self._hooks.append(model.register_state_dict_post_hook(lambda *args: self.forget_decoded()))
        # a wrapper made after offload (get_peft_model, nn.Sequential) loads through the model's own
        # _load_from_state_dict, whose pre-hook runs before any of the model's tensors is written
        self._hooks.append(model.register_load_state_dict_pre_hook(self._load_hook))
        for module in self.modules:
            for name, method in _PATCHES.items():
                module.__dict__[name] = types.MethodType(method, module)  # past nn.Module.__setattr__
            module.__dict__["_ws_guards"] = self
        self.peft: list[nn.Module] = []  # PEFT tuner layers whose merge and unmerge refuse
        self.guard_peft(model)

    def guard_peft(self, module: nn.Module) -> None:
        """Make every PEFT tuner layer in `module` refuse `merge()` and `unmerge()` (what merge_adapter,
        merge_and_unload and diffusers' fuse_lora call per layer) before it writes anything: over a
        streamed weight the write would land in a shared staging buffer, over a resident one it would
        go through while the streamed layers' could not, leaving the model in neither state."""
        for layer in module.modules():
            tuner = isinstance(getattr(layer, "merged_adapters", None), list)
            if tuner and hasattr(layer, "get_base_layer") and "merge" not in layer.__dict__:
                for name in ("merge", "unmerge"):
                    layer.__dict__[name] = types.MethodType(_refused_merge(type(layer), name), layer)
                self.peft.append(layer)
            # a diffusers model's fuse_lora scales each layer before merging it: refused before that
            if callable(getattr(type(layer), "fuse_lora", None)) and "fuse_lora" not in layer.__dict__:
                for name in ("fuse_lora", "unfuse_lora"):
                    layer.__dict__[name] = types.MethodType(_refused_merge(type(layer), name), layer)
                self.peft.append(layer)

    def _load_hook(self, module, state_dict, prefix, *args) -> None:
        """Refuse a load reaching the model from a module above it that names a tensor kept off the GPU
        (as `load_state_dict` on the model itself does), before anything in the model is written."""
        _refuse_loading_off_gpu(module, {key.removeprefix(prefix) for key in state_dict
                                         if key.startswith(prefix)}, self)

    def _off_gpu(self):
        """(entry, arena region, slice) of every tensor kept off the GPU: the streamed groups' (regions
        0..), then the zero-copy groups' (after them, as in the arena)."""
        for g, group in enumerate(self.engine.groups + self.engine.uva_groups):
            for entry, sl in group:
                yield entry, g, sl

    def _true_tensors(self) -> dict[int, tuple]:
        return {id(entry.tensor): (entry, g, sl) for entry, g, sl in self._off_gpu()}

    def true_value(self, tensor: torch.Tensor) -> torch.Tensor:
        """The true weights of `tensor` as a CPU tensor when it is kept off the GPU (streamed or zero
        copy), else `tensor` itself."""
        found = self._true.get(id(tensor))
        if found is None:
            return tensor
        entry, g, sl = found
        transfer = self.engine.transfer
        if g < len(self.engine.groups) and transfer.on_disk(g):
            raw = torch.empty(sl.nbytes, dtype=torch.uint8)
            # one stored tensor, or the pieces of a fused one; checked against the files as at load
            transfer.disk.read_group(g, raw, within=(sl.offset, sl.nbytes))
            return self._copy(entry, raw)
        wire = self.engine.wire
        if g < len(wire) and wire[g] is not None:  # compressed in the arena: decode the group
            if self._decoded[0] != g:
                self._decoded = (g, transfer.raw_group(g).cpu())
            return self._copy(entry, self._decoded[1][sl.offset : sl.offset + sl.nbytes].clone())
        if g - len(self.engine.groups) in self.engine.coded_experts:  # routed experts held coded: decode
            if self._decoded[0] != g:
                self._decoded = (g, self.engine.zero_copy_bytes(g))
            return self._copy(entry, self._decoded[1][sl.offset : sl.offset + sl.nbytes].clone())
        return entry.view_of(self.engine.arena.region(g)[sl.offset : sl.offset + sl.nbytes])

    def _copy(self, entry, raw: torch.Tensor) -> torch.Tensor:
        """`entry` as a copy of its true bytes `raw`, remembered so that a write to it (which the weights
        never see) is refused at the next forward (`lost_writes`)."""
        value = entry.view_of(raw)
        if entry.flat is None:
            if len(self._copies) > 4096:
                self._copies = [c for c in self._copies if c[0]() is not None]
            self._copies.append((weakref.ref(value), value._version, entry.name))
        return value

    def wrapped(self, value: torch.Tensor) -> TrueWeight:
        """`value` (from `true_value`) as the parameter parameters() gives; a copy's record (`_copy`)
        then watches the parameter, whose writes do not move the copy's version."""
        param = TrueWeight(value, requires_grad=False)
        if self._copies and self._copies[-1][0]() is value:  # `_copy` recorded it last, just now
            self._copies[-1] = (weakref.ref(param), param._version, self._copies[-1][2])
        return param

    def lost_writes(self) -> list[str]:
        """Names of the tensors whose copies (`_copy`) were written in place since handed out (each
        reported once); copies no longer referenced are forgotten."""
        lost, kept = [], []
        for ref, version, name in self._copies:
            value = ref()
            if value is not None and value._version != version:
                lost.append(name)
            elif value is not None:
                kept.append((ref, version, name))
        self._copies = kept
        return lost

    def remember_true(self, tensor: torch.Tensor, where: tuple) -> None:
        """`tensor` streams again, at `where` ((entry, group, slice), as `_true_tensors` gives them)."""
        self._true[id(tensor)] = where

    def forget(self, tensor: torch.Tensor) -> None:
        """`tensor` no longer streams (the model writes it, or rebound it): it is its own true value."""
        self._true.pop(id(tensor), None)

    def forget_decoded(self) -> None:
        """Drop the host copy of the last compressed group decoded for `true_value` (kept while a
        state_dict or a parameters() walk reads that group's tensors one by one)."""
        self._decoded = (None, None)

    def _state_dict_hook(self, names):
        def hook(module, state_dict, prefix, local_metadata):
            for name, entry in names:
                if state_dict.get(prefix + name) is not None and _holds(module, name, entry.tensor):
                    state_dict[prefix + name] = self.true_value(entry.tensor)
        return hook

    def remove(self) -> None:
        """Take every guard off, give each parameter its `requires_grad` back and each module its
        training mode."""
        _LIVE.discard(self)
        for layer in self.peft:
            for name in ("merge", "unmerge", "fuse_lora", "unfuse_lora"):
                layer.__dict__.pop(name, None)
        for hook in self._hooks:
            hook.remove()
        for module in self.modules:
            for name in (*_PATCHES, "_ws_guards"):
                module.__dict__.pop(name, None)
        for p in self.grads:
            with torch.inference_mode(p.is_inference()):  # torch allows this for an inference tensor there
                p.requires_grad_(True)
        for module, training in zip(self.modules, self.training, strict=True):
            module.training = training


def _holds(module: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Whether `module.<name>` (a parameter or buffer) is still `tensor` (the model did not rebind it)."""
    return module._parameters.get(name, module._buffers.get(name)) is tensor


def live_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of `module` as its forward reads them: for an offloaded model the streamed ones
    are the staging-slot views, whose contents are not the weights between forwards. For tests and
    tools that inspect the engine; `parameters()` gives the true weights."""
    return [p for _, p in nn.Module.named_parameters(module)]


def _guarded_train(self, mode: bool = True):
    if mode:
        raise InferenceOnlyError(INFERENCE_ONLY.format(what="train()"))
    return nn.Module.train(self, False)


def _guarded_requires_grad(self, requires_grad: bool = True):
    if requires_grad:
        raise InferenceOnlyError(INFERENCE_ONLY.format(what="requires_grad_(True)"))
    for p in live_parameters(self):  # the live tensors, not the true-weight copies parameters() gives
        p.requires_grad_(False)
    return self


class TrueWeight(nn.Parameter):
    """What `parameters()` gives for a weight kept off the GPU: its true bytes as a parameter (a view of
    its host memory, or a copy). Giving it other memory (`p.data = other`, as vector_to_parameters
    does) is refused: on a resident model that replaces the weight, here it would reach nothing. So is
    turning its gradient on (`p.requires_grad = True`, `p.requires_grad_()`): the forward reads the
    staging slots, not this tensor, so it would get no gradient where the resident model's weight does."""

    def __setattr__(self, name, value):
        if name == "data":
            raise OffloadStateError(
                "this parameter was given by parameters() of a model offloaded by weightstream: it holds the "
                "weight's true bytes, and giving it other memory (`.data = ...`, as "
                "torch.nn.utils.vector_to_parameters does) would not reach the model. Edit weights in "
                "place inside `with handle.edit():`, or call handle.restore() first")
        if name == "requires_grad" and value:
            raise InferenceOnlyError(INFERENCE_ONLY.format(what="requires_grad = True on its weights"))
        super().__setattr__(name, value)

    def requires_grad_(self, requires_grad: bool = True):
        if requires_grad:
            raise InferenceOnlyError(INFERENCE_ONLY.format(what="requires_grad_() on its weights"))
        return super().requires_grad_(False)


def _true_members(self, members: Iterator[tuple[str, torch.Tensor]], is_param: bool):
    guards = self.__dict__["_ws_guards"]
    try:
        for name, tensor in members:
            value = guards.true_value(tensor)
            if value is not tensor and is_param:
                value = guards.wrapped(value)
            yield name, value
    finally:  # the walk ended (or was dropped): no decoded group stays on the host
        guards.forget_decoded()


def _guarded_named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
    members = nn.Module.named_parameters(self, prefix, recurse, remove_duplicate)
    if torch.compiler.is_compiling():
        return members
    return _true_members(self, members, True)


def _guarded_named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
    members = nn.Module.named_buffers(self, prefix, recurse, remove_duplicate)
    if torch.compiler.is_compiling():
        return members
    return _true_members(self, members, False)


def _guarded_load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
    """Load as torch does where no key names a tensor kept off the GPU (LoRA adapters added after
    offload, resident weights); refuse where one does: it would write into a staging buffer."""
    _refuse_loading_off_gpu(self, state_dict, self.__dict__["_ws_guards"])
    return nn.Module.load_state_dict(self, state_dict, strict=strict, assign=assign)


def _refuse_loading_off_gpu(module: nn.Module, keys, guards: ModelGuards) -> None:
    """OffloadStateError where a key of `keys` (relative to `module`) names a tensor kept off the GPU."""
    held = dict(nn.Module.named_parameters(module, remove_duplicate=False))
    held.update(nn.Module.named_buffers(module, remove_duplicate=False))
    off_gpu = [key for key in keys if key in held and id(held[key]) in guards._true]
    if off_gpu:
        raise OffloadStateError(
            f"{type(module).__name__} is offloaded by weightstream: load_state_dict would write "
            f"{off_gpu[0]}{f' and {len(off_gpu) - 1} more' if len(off_gpu) > 1 else ''} into staging buffers "
            "that the next copy overwrites. Load them inside `with handle.edit():`, or call "
            "handle.restore() first, load, then offload again (a state dict of other tensors, such as "
            "LoRA adapters, loads as it is)"
        )


def _refused_merge(cls: type, name: str):
    """`cls.<name>` refusing while offloaded, with its signature (diffusers inspects merge's); an undoing
    (unmerge, unfuse_lora) with nothing merged in its module is let through: it does nothing."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def refuse(self, *args, **kwargs):
        if name.startswith("un") and not any(getattr(m, "merged_adapters", None) for m in self.modules()):
            return original(self, *args, **kwargs)
        raise OffloadStateError(
            f"PEFT {name}() on {type(self).__name__} of a model offloaded by weightstream (merge_adapter, "
            "merge_and_unload, fuse_lora and their undoing call it): it would write base weights that "
            "stream through staging buffers other blocks share. Nothing was changed; merge inside `with "
            "handle.edit():` or before offload()")
    return refuse


def _guarded_deepcopy(self, memo):
    raise OffloadStateError(
        f"{type(self).__name__} is offloaded by weightstream: a deep copy would share or duplicate its "
        "staging buffers and stream wrong weights. Deep-copy the model before offload(), or call "
        "handle.restore() first; model.state_dict() gives the true weights"
    )


def _guarded_reduce_ex(self, protocol):
    raise OffloadStateError(
        f"{type(self).__name__} is offloaded by weightstream: pickling it (torch.save(model)) would save "
        "staging buffers, not its weights. Save model.state_dict() (true weights) or save_pretrained(), "
        "or call handle.restore() first"
    )


_PATCHES = {
    "train": _guarded_train,
    "requires_grad_": _guarded_requires_grad,
    "named_parameters": _guarded_named_parameters,  # parameters() calls it
    "named_buffers": _guarded_named_buffers,  # buffers() calls it
    "load_state_dict": _guarded_load_state_dict,
    "__deepcopy__": _guarded_deepcopy,
    "__reduce_ex__": _guarded_reduce_ex,
}
