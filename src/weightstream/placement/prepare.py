"""Preparing an offload: check the model, find its blocks and tensors, build the cost model's view of
it and plan the placement (`plan.py`), group the off-GPU tensors into byte layouts, and decide every
tensor's final place. Moves nothing: `offload.py` (and `hf.py`, which reads a checkpoint straight into
the places) does the moving.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import OffloadConfig, config_of
from ..devices import resolve_device
from ..engine.guards import held_by
from ..engine.host import HostArena
from ..errors import ArgumentError, OffloadStateError
from ..sizes import format_size
from ..wire.codec import choose
from .blocks import find_blocks
from .cost import ModelCost, largest
from .entries import Entry, _collect
from .layout import Slice, pack
from .plan import Placement, plan, with_routing_skew
from .probe import MachineProfile, load_profile

# diffusers' hooks that move or recast a module's weights in every forward, by the names diffusers
# registers them under (diffusers/hooks/group_offloading.py, layerwise_casting.py), and what set them
_GROUP_OFFLOADING = ("group_offloading", "lazy_prefetch_group_offloading", "layer_execution_tracker")
_DIFFUSERS_WEIGHT_HOOKS = {
    **{name: "diffusers' group offloading (enable_group_offload or apply_group_offloading), which moves "
             "the same weights: offload a model loaded without it (diffusers has no call that undoes it "
             "and puts the weights back as they were)" for name in _GROUP_OFFLOADING},
    "layerwise_casting": "diffusers' layerwise casting (enable_layerwise_casting or "
                         "apply_layerwise_casting), which recasts the weights in every forward: offload "
                         "a model loaded without it",
}


def _diffusers_hooks(module: nn.Module) -> list[str]:
    """The names of the diffusers hooks registered on `module` (its `HookRegistry`), in order."""
    return list(getattr(getattr(module, "_diffusers_hook", None), "hooks", {}))


def foreign_offloading(model: nn.Module) -> str | None:
    """What another offloader left on `model`, as an error message naming the first module it is on and
    how to remove it, or None: diffusers' hooks that move or recast weights (group offloading,
    layerwise casting), or accelerate's hooks (from `enable_model_cpu_offload`,
    `enable_sequential_cpu_offload`, `cpu_offload` or a device map that offloads or spans devices).
    Either moves or rewrites the same weights in every forward, so the two would fight over them."""
    for path, m in model.named_modules():
        where = f"module '{path}' ({type(m).__name__})" if path else f"the model ({type(m).__name__})"
        names = [n for n in _diffusers_hooks(m) if n in _DIFFUSERS_WEIGHT_HOOKS]
        if names:
            return f"{where} has {_DIFFUSERS_WEIGHT_HOOKS[names[0]]} ({', '.join(names)} hooks)"
        if getattr(m, "_hf_hook", None) is not None:
            return (f"{where} has accelerate hooks (from enable_model_cpu_offload, "
                    "enable_sequential_cpu_offload, accelerate's cpu_offload or dispatch_model, or a "
                    "device_map that offloads or spans devices), which move weights and inputs in every "
                    "forward: remove them first (`pipe.remove_all_hooks()` for a pipeline, or "
                    "`accelerate.hooks.remove_hook_from_module(model, recurse=True)`), or load the model "
                    "onto one device without offloading")
    return None


def replaced_forward(blocks) -> str | None:
    """An error message naming the first of `blocks` (`blocks.Block`s) whose `forward` is replaced on
    the module itself (an instance attribute: diffusers' hooks such as apply_first_block_cache or
    FasterCache, or code that assigns `module.forward`), or None. Such a forward calls the block's
    original class forward and would bypass the streaming forward that weightstream's class swap
    installs: the block would compute from whatever its staging slot holds."""
    for block in blocks:
        if "forward" in vars(block.module):
            hooks = _diffusers_hooks(block.module)
            by = f" by diffusers hooks ({', '.join(hooks)})" if hooks else ""
            return (f"block '{block.name}' ({type(block.module).__name__}) has its forward replaced on the "
                    f"module itself{by}, which would bypass the forward that makes a streamed block wait "
                    "for its weights: offload a model without it (remove the hooks, or the assignment to "
                    "`.forward`)")
    return None


def _check_model(model: nn.Module, blocks, entries: list[Entry], allow_meta: bool) -> None:
    """Refuse a model weightstream cannot offload as it is: offloaded already, managed by another
    offloader, a repeated block (of `blocks`) whose forward is replaced on the module, or (unless
    `allow_meta`) weights on the meta device."""
    if any("_ws_guards" in m.__dict__ for m in model.modules()):  # engine/guards.py marks every module
        raise OffloadStateError(
            "this model (or a submodule) is already offloaded: call handle.restore() before offloading again"
        )
    foreign = foreign_offloading(model)
    if foreign is not None:
        raise OffloadStateError(f"weightstream cannot offload a model another offloader manages: {foreign}")
    replaced = replaced_forward(blocks)
    if replaced is not None:
        raise OffloadStateError(f"weightstream cannot stream this model's blocks: {replaced}")
    for entry in entries:
        site = entry.sites[0]
        owner = held_by(entry.tensor)
        if owner is not None:
            raise OffloadStateError(
                f"{entry.name} is the very tensor object an offloaded {owner} holds as one of its weights: "
                "weightstream moves each offloaded tensor's bytes into its own staging and host memory, so "
                "two offloaded models cannot share one. Give this model its own copy (e.g. "
                "nn.Parameter(t.detach().clone())), offload the two as one module, or restore the other "
                "first")
        if entry.tensor.is_meta and not allow_meta:
            raise OffloadStateError(
                f"{type(site.module).__name__}.{site.name} is on the meta device: load the weights first "
                "(e.g. from_pretrained, or model.to_empty() and a state dict)"
            )



@dataclass
class Prepared:
    """A model whose placement is decided but whose tensors are not yet in their final places."""

    model: nn.Module
    device: torch.device
    block_names: list[str]
    block_modules: list[nn.Module]
    entries: list[Entry]
    placement: Placement
    groups: list[list[tuple[Entry, Slice]]]  # streamed groups, in forward order
    group_bytes: list[int]
    uva_groups: list[list[tuple[Entry, Slice]]]  # zero-copy blocks
    uva_group_bytes: list[int]
    cost: ModelCost
    wire: list | None = None  # each streamed group's codec.EncodedGroup (None: raw); None: nothing coded
    budget: int = 0  # the gpu_memory asked for, in bytes
    block_lists: list[str] | None = None  # the `blocks` asked for (None: found automatically)
    # coded expert copies: zero-copy group -> its experts' records in its arena region
    # (engine/coded_experts.Record); empty: none coded
    coded_experts: dict[int, list] = field(default_factory=dict)

    @property
    def host_groups(self) -> list[list[tuple[Entry, Slice]]]:
        """Every group whose bytes live in the host arena: streamed ones, then zero-copy ones."""
        return self.groups + self.uva_groups

    @property
    def host_group_bytes(self) -> list[int]:
        return self.group_bytes + self.uva_group_bytes


def _plain(entry: Entry) -> bool:
    """True for a plain tensor (the codec codes its bytes); a tensor subclass streams raw."""
    return entry.flat is None and type(entry.tensor) in (torch.Tensor, nn.Parameter)


def _wire_nbytes(entry: Entry) -> int:
    """An entry's predicted bytes on the wire when compressed (codec.choose); raw for a subclass."""
    return choose(entry.tensor).nbytes if _plain(entry) else entry.nbytes


def model_cost(entries: list[Entry], per_block: list[list[Entry]], slot_bytes: list[int], width: int = 0,
               routing: tuple[int, int] = (0, 0), wire: bool = False) -> ModelCost:
    """The cost model's view of a model: fixed bytes, LM head bytes, each block's streamable bytes and
    staging footprint, the blocks' activation width (0 when unknown) and, for a mixture of experts with
    `routing` = (experts, experts per token), each block's bytes of routed experts: its 3-D tensors
    whose first dimension is the expert. `wire`: also each tensor's predicted compressed size
    (codec.choose, from a sample of its exponents)."""
    outside = [e.nbytes for e in entries if e.owner is None]
    block_bytes = tuple(sum(e.nbytes for e in group) for group in per_block)
    tensor_bytes = tuple(tuple(e.nbytes for e in group) for group in per_block)
    experts, top_k = routing
    positions = tuple(tuple(i for i, e in enumerate(group) if _routed(e, experts)) for group in per_block)
    routed = tuple(sum(group[i].nbytes for i in at) for group, at in zip(per_block, positions, strict=True))
    routed = routed if experts else ()
    quant = tuple(sum(e.nbytes for e in group if e.bf16_bytes != e.nbytes) for group in per_block)
    quant_bf16 = tuple(sum(e.bf16_bytes for e in group if e.bf16_bytes != e.nbytes) for group in per_block)
    tensor_wire = tuple(tuple(_wire_nbytes(e) for e in group) for group in per_block) if wire else ()
    return ModelCost(sum(outside), max(outside, default=0), block_bytes, tuple(slot_bytes), width,
                     tensor_bytes, routed if any(routed) else (), experts, top_k,
                     quant if any(quant) else (), quant_bf16 if any(quant) else (), tensor_wire,
                     positions if any(routed) else ())


def _routed(entry: Entry, experts: int) -> bool:
    """Whether `entry` holds routed experts: a 3-D tensor whose first dimension is the expert (the fused
    layout transformers 5 builds mixtures of experts with)."""
    return experts > 0 and len(entry.shape) == 3 and entry.shape[0] == experts


def expert_routing(model: nn.Module) -> tuple[int, int]:
    """(experts, experts per token) of a transformers mixture-of-experts model, from its config
    (`num_local_experts` or `num_experts`, and `num_experts_per_tok`); (0, 0) for any other model."""
    config = getattr(model, "config", None)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if isinstance(experts, int) and isinstance(top_k, int) and 0 < top_k < experts:
        return experts, top_k
    return 0, 0


def activation_width(model: nn.Module) -> int:
    """The hidden size of a transformers model (its config's `hidden_size`), else 0: the cost model
    then counts GEMM time only."""
    width = getattr(getattr(model, "config", None), "hidden_size", None)
    return width if isinstance(width, int) and width > 0 else 0


def _caller_level() -> int:
    """The `stacklevel` of a warning from the function calling this one that names the line outside
    weightstream (and torch's decorators between its functions) which asked: the user's `offload`,
    `from_pretrained` or `plan_report` call, whichever path led here."""
    import sys
    from pathlib import Path

    inside = (str(Path(__file__).parents[1]), str(Path(torch.__file__).parent))
    frame, level = sys._getframe(2), 2  # the caller's caller: level 2 of warnings.warn there
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def prepare(
    model: nn.Module,
    gpu_memory: int | str | OffloadConfig,
    device: str | torch.device | None = None,
    blocks: list[str] | None = None,
    allow_meta: bool = False,
    strategy: str = "auto",
    tokens: int = 1,
    pin_memory: bool = True,
    profile: MachineProfile | None = None,
    host_bytes: int | None = None,
    placement: Placement | None = None,
    compress: bool | str = "auto",
    predict_wire: bool | None = None,
    keep_resident: Collection[str] = (),
    experts_apart: bool = True,
) -> Prepared:
    """Check the model and plan what stays on `device`, what streams and what is read in place
    (zero copy); moves nothing yet.

    allow_meta: accept parameters on the meta device (a model built empty, to be filled from a
    checkpoint straight into its final places). strategy, tokens, profile, placement, compress: see
    `offload`. host_bytes: host memory for the offloaded weights (see `plan.plan`; None: no limit).
    predict_wire: give the cost each tensor's predicted compressed size (`codec.choose`, about 6 ms per
    72 MiB tensor) unless `compress` is False; None: only when the planner runs (no `placement`
    given), since an explicit placement does not use them. keep_resident: see `offload`. experts_apart:
    see `plan.plan` (False: zero-copy blocks of a mixture of experts are read in place whole).
    `gpu_memory` may be an `OffloadConfig` (then the other arguments it holds stay at their defaults).
    """
    config = config_of(gpu_memory, device=device, blocks=blocks, strategy=strategy, tokens=tokens,
                       pin_memory=pin_memory, profile=profile, placement=placement, compress=compress,
                       keep_resident=keep_resident)
    budget, strategy, tokens = config.gpu_memory, config.strategy, config.tokens
    device = resolve_device(config.device)  # with its index
    profile, placement, compress, blocks = config.profile, config.placement, config.compress, config.blocks
    if not isinstance(model, nn.Module):
        raise ArgumentError(f"offload() takes an nn.Module, got {type(model).__name__}")
    blocks = list(blocks) if blocks is not None else None
    found = find_blocks(model, blocks)
    block_modules = [b.module for b in found]
    keep = frozenset(config.keep_resident)
    entries = _collect(model, block_modules, keep)
    unknown = keep - {e.name for e in entries}
    if unknown:
        raise ArgumentError(f"keep_resident names {', '.join(sorted(unknown))}, which the model does not "
                            "have: give qualified names of parameters or buffers as model.state_dict() "
                            "lists them")
    _check_model(model, found, entries, allow_meta)

    per_block: list[list[Entry]] = [[] for _ in found]
    for entry in entries:
        if entry.owner is not None:
            per_block[entry.owner].append(entry)
    layouts = [pack([e.nbytes for e in group]) for group in per_block]
    wire = compress is not False and (placement is None if predict_wire is None else predict_wire)
    cost = model_cost(entries, per_block, [size for _, size in layouts], activation_width(model),
                      expert_routing(model), wire=wire)
    cost = with_routing_skew(cost, config.routing_skew)  # what a GPU expert cache of k slots serves
    if placement is None:
        unrouted = [text for text, on in (
            (f"routing_skew={config.routing_skew!r}", config.routing_skew is not None),
            ("expert_copies=True", config.expert_copies)) if on]
        if unrouted and not cost.experts:
            warnings.warn(
                f"weightstream: {' and '.join(unrouted)} ignored: {type(model).__name__} is not a mixture of "
                "experts (its config names no num_local_experts or num_experts with num_experts_per_tok), "
                "so there are no routed experts to plan for; drop them", stacklevel=_caller_level())
        profile = load_profile(device) if profile is None else profile
        placement = plan(cost, budget, tokens, profile, strategy, host_bytes=host_bytes, compress=compress,
                         experts_apart=experts_apart, expert_cache=config.expert_cache,
                         expert_copies=config.expert_copies)
        if config.expert_copies and cost.experts and not placement.expert_copies and placement.kind != \
                "resident":
            warnings.warn(
                f"weightstream: expert_copies=True, but the placement the planner predicts fastest "
                f"({placement.kind}: {len(placement.streamed)} blocks streamed, {len(placement.uva)} read in "
                f"place, {len(placement.uva_experts)} of them for their routed experts alone) copies no "
                "expert: none is read apart, or the copies' work buffers do not fit the budget beside it. "
                "Give more gpu_memory, or force copies with placement=plan.placement_of(..., "
                "uva_experts=..., expert_copies=...)", stacklevel=_caller_level())
        if compress is True and placement.kind != "resident" and not (placement.compressed
                                                                       or placement.copy_landing_bytes):
            shrinks = any(sum(w) < sum(b) for w, b in zip(cost.tensor_wire, cost.tensor_bytes, strict=True))
            why = ("no placement that moves them compressed fits the budget beside its landing buffers (or "
                   "it reads them in place, which is never compressed). Give more gpu_memory, or "
                   "compress='auto' (compressed only where predicted faster)" if shrinks
                   else "its weights would not shrink (the codec's predicted sizes): compress=False")
            warnings.warn(
                f"weightstream: compress=True, but the planner's placement ({placement.kind}: "
                f"{len(placement.streamed)} blocks streamed, {len(placement.uva)} read in place) moves raw "
                f"bytes over the link: {why}", stacklevel=_caller_level())
    elif placement.gpu_bytes > budget or max(placement.streamed + placement.uva, default=-1) >= len(found):
        raise ArgumentError(
            f"the given placement needs {format_size(placement.gpu_bytes)} of GPU memory for blocks up to "
            f"{max(placement.streamed + placement.uva, default=-1)}; the budget is {format_size(budget)} "
            f"and the model has {len(found)} blocks: make it with plan.placement_of for this model"
        )
    elif not all(cost.experts_apart(i) for i in placement.uva_experts):
        raise ArgumentError(
            f"the given placement reads blocks {placement.uva_experts} for their routed experts only, but "
            "not all of them hold routed expert tensors beside other tensors in this model: make it with "
            "plan.placement_of for this model")

    def grouped(indices, part=0, experts=()):
        """Each block's (entry, slice) pairs and region size: its `part` largest tensors (0: all), or
        for blocks of `experts` its routed expert tensors."""
        groups, sizes = [], []
        for i in indices:
            at = cost.routed_tensors[i] if i in experts else largest(cost.tensor_bytes[i], part)
            chosen = [per_block[i][j] for j in at]
            slices, size = pack([e.nbytes for e in chosen]) if part or i in experts else layouts[i]
            groups.append(list(zip(chosen, slices, strict=True)))
            sizes.append(size)
        return groups, sizes

    groups, group_bytes = grouped(placement.streamed, placement.part)
    uva_groups, uva_group_bytes = grouped(placement.uva, experts=placement.uva_experts)
    return Prepared(model, device, [b.name for b in found], block_modules, entries, placement, groups,
                    group_bytes, uva_groups, uva_group_bytes, cost, budget=budget, block_lists=blocks)


def final_places(
    prep: Prepared, arena: HostArena, keep_on_device: bool, disk_groups: frozenset[int] = frozenset()
) -> dict[int, torch.Tensor]:
    """The final home of every entry, keyed by id(entry): a view into the host arena for a streamed
    tensor, a tensor on the device for a resident one (the entry's own when `keep_on_device` and it is
    already there, else a new empty one). Entries of `disk_groups` have none: they stay in their files."""
    places: dict[int, torch.Tensor] = {}
    for g, group in enumerate(prep.host_groups):
        if g in disk_groups:
            continue
        region = arena.region(g)
        for entry, sl in group:
            places[id(entry)] = entry.view_of(region[sl.offset : sl.offset + sl.nbytes])
    off_device = {id(e) for group in prep.host_groups for e, _ in group}
    for entry in prep.entries:
        if id(entry) in off_device:
            continue
        if keep_on_device and entry.tensor.device == prep.device:
            places[id(entry)] = entry.own()
        else:
            places[id(entry)] = entry.empty(prep.device)
    return places

