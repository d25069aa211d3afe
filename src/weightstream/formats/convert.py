"""Checkpoint layouts transformers converts on load, read straight into the model's tensors.

transformers 5 builds some models with tensors the checkpoint stores differently: Mixtral's
`block_sparse_moe.experts.0.w1.weight` ... `experts.7.w3.weight` become one `mlp.experts.gate_up_proj`
of shape [experts, 2 * intermediate, hidden], and `save_pretrained` writes the per-expert layout back.
It converts on load with its own rules (`transformers.conversion_mapping`: `WeightRenaming`, and
`WeightConverter`s whose operations are `MergeModulelist`, `Concatenate`, `Chunk`...). `sources()`
applies those same rules, in transformers' own order, to the checkpoint's names: every model tensor
gets a `Source`, the stored tensors it is made of. Where the operations only place blocks (stacking
along a dim, concatenating along a dim: every MoE expert fusion) each stored tensor is read straight
into its region of the tensor's final place, one positional read where the region is contiguous. Any
other operation runs transformers' own `convert` on the stored tensors, one model tensor at a time.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from .checkpoint import StoredTensor, read_into

Index = tuple[int | slice, ...]


@dataclass(frozen=True)
class Read:
    """One stored tensor and the region of a model tensor it fills (`index`: () = all of it)."""

    stored: StoredTensor
    index: Index = ()


@dataclass
class Source:
    """Where one model tensor comes from. `reads`: the stored tensors it is made of, each read into its
    region (or, with `converter`, handed to that transformers `WeightConverter` whose output named
    `name` is the tensor). `shape`: the shape they make; `dtype`: their stored dtype."""

    name: str
    reads: list[Read]
    shape: tuple[int, ...]
    dtype: torch.dtype
    converter: Any = None
    patterns: dict[str, list[StoredTensor]] = field(default_factory=dict)
    layer: str = ""
    model: Any = None  # what transformers' convert is given (some operations read its config)

    @property
    def nbytes(self) -> int:
        """Bytes read from the checkpoint."""
        return sum(r.stored.nbytes for r in self.reads)

    @property
    def converted(self) -> bool:
        """True when the tensor is not stored as it is under its own name."""
        return self.converter is not None or any(r.index != () for r in self.reads)

    def regions(self, itemsize: int) -> list[tuple[StoredTensor, int]] | None:
        """Each read with the byte offset of its region in the tensor (elements of `itemsize` bytes),
        or None when a region is not contiguous (or transformers' convert makes the tensor)."""
        if self.converter is not None:
            return None
        whole = torch.empty(self.shape, device="meta")
        out = []
        for read in self.reads:
            region = whole[read.index]
            if not region.is_contiguous():
                return None
            out.append((read.stored, region.storage_offset() * itemsize))
        return out

    def fill(self, dst: torch.Tensor, bounce: torch.Tensor | None = None) -> None:
        """Read the stored tensors into `dst` (the model tensor's place: this shape, the model's
        dtype, on any device), converting the dtype where the model's differs. `bounce`: a uint8 CPU
        buffer of at least the largest read's bytes (default: allocated here)."""
        if self.converter is not None:
            dst.copy_(_run(self.converter, self.patterns, self.layer, self.model, dst.dtype)[self.name])
            return
        if bounce is None:
            bounce = torch.empty(max(r.stored.nbytes for r in self.reads), dtype=torch.uint8)
        for read in self.reads:
            region, stored = dst[read.index], read.stored
            if region.device.type == "cpu" and stored.dtype == dst.dtype and region.is_contiguous():
                read_into(stored, region)
            else:
                raw = bounce[: stored.nbytes].view(stored.dtype).view(stored.shape)
                read_into(stored, raw)
                region.copy_(raw)  # to the device and/or to the model's dtype


def _run(converter, collected: dict[str, list[StoredTensor]], layer: str, model, dtype: torch.dtype,
         meta: bool = False) -> dict[str, torch.Tensor]:
    """transformers' own conversion of the stored tensors `collected` (by source pattern; each cast to
    `dtype` first, as transformers does), by output name; `meta`: on meta tensors, for shapes only."""

    def load(stored: StoredTensor):
        if meta:
            return lambda: torch.empty(stored.shape, dtype=dtype, device="meta")

        def read():
            raw = torch.empty(stored.shape, dtype=stored.dtype)
            read_into(stored, raw)
            return raw.to(dtype)
        return read

    converter = copy.deepcopy(converter)
    for pattern, stored in collected.items():
        converter.collected_tensors[pattern] = [load(s) for s in stored]
    out = converter.convert(layer, model=model, config=getattr(model, "config", None))
    return {name: t[0] if isinstance(t, list) else t for name, t in out.items()}


def _transformers_rules():
    """transformers' conversion API (None where this transformers has none: names load as stored)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            Concatenate,
            MergeModulelist,
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )
    except ImportError:
        return None
    return dict(mapping=get_model_conversion_mapping, concatenate=Concatenate, merge=MergeModulelist,
                converter=WeightConverter, renaming=WeightRenaming, key=dot_natural_key,
                rename=rename_source_key)


def _is_transformers_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


@dataclass
class _Block:
    """A tensor during the simulated conversion: its shape and where each stored tensor sits in it
    (one index entry per dim: an int for a dim the stored tensor lacks, else a slice)."""

    shape: tuple[int, ...]
    reads: list[Read]


def _stack(blocks: list[_Block], dim: int, name: str, folder: Path) -> _Block:
    shapes = {b.shape for b in blocks}
    if len(shapes) != 1:
        raise CheckpointError(f"{folder}: the tensors fused into {name} have different shapes "
                              f"{sorted(shapes)}: the checkpoint does not match config.json")
    shape = blocks[0].shape
    dim = dim + len(shape) + 1 if dim < 0 else dim
    reads = [Read(r.stored, r.index[:dim] + (i,) + r.index[dim:])
             for i, b in enumerate(blocks) for r in b.reads]
    return _Block(shape[:dim] + (len(blocks),) + shape[dim:], reads)


def _cat(blocks: list[_Block], dim: int, name: str, folder: Path) -> _Block:
    ndim = len(blocks[0].shape)
    dim = dim + ndim if dim < 0 else dim
    rest = {b.shape[:dim] + b.shape[dim + 1:] for b in blocks}
    if len(rest) != 1 or any(len(b.shape) != ndim for b in blocks):
        raise CheckpointError(f"{folder}: the tensors concatenated into {name} have shapes "
                              f"{[list(b.shape) for b in blocks]}: an expert is missing from the checkpoint "
                              "or it does not match config.json")
    reads, offset = [], 0
    for b in blocks:
        for r in b.reads:
            at = r.index[dim]
            moved = at + offset if isinstance(at, int) else slice(at.start + offset, at.stop + offset)
            reads.append(Read(r.stored, r.index[:dim] + (moved,) + r.index[dim + 1:]))
        offset += b.shape[dim]
    shape = blocks[0].shape
    return _Block(shape[:dim] + (offset,) + shape[dim + 1:], reads)


def _placed(rules, converter, collected: dict[str, list[StoredTensor]], name: str,
            folder: Path) -> _Block | None:
    """The converter's operations followed on the tensors' places, as transformers' `convert` runs
    them (MergeModulelist stacks each pattern's list, or names it the target when alone; Concatenate
    joins the patterns in the converter's order); None when an operation is not a placement."""
    state: dict[str, Any] = {
        pattern: [_Block(s.shape, [Read(s, tuple(slice(0, n) for n in s.shape))]) for s in stored]
        for pattern, stored in collected.items()}
    targets = converter.target_patterns
    for op in converter.operations:
        if type(op) is rules["merge"]:
            if len(state) == 1 and len(targets) != 1:
                return None
            state = {targets[0] if len(state) == 1 else pattern:
                     value if isinstance(value, _Block) else _stack(value, op.dim, name, folder)
                     for pattern, value in state.items()}
        elif type(op) is rules["concatenate"]:
            if len(targets) != 1:
                return None
            parts = []
            for pattern in converter.source_patterns:
                value = state.pop(pattern, None)
                parts += [] if value is None else value if isinstance(value, list) else [value]
            if not parts:
                return None
            state = {targets[0]: _cat(parts, op.dim, name, folder)}
        else:
            return None
    if len(state) != 1:
        return None
    (block,) = state.values()
    if isinstance(block, list):
        if len(block) != 1:
            return None
        block = block[0]
    return block


def sources(model: nn.Module, stored: dict[str, StoredTensor], folder: Path
            ) -> tuple[dict[str, Source], list[str]]:
    """Every model tensor the checkpoint's tensors `stored` (by name) make, by the model's state-dict
    name, after transformers' conversion rules for this model; and the stored names that make none."""
    rules = _transformers_rules()
    if rules is None or not _is_transformers_model(model):
        return {name: Source(name, [Read(s)], s.shape, s.dtype) for name, s in stored.items()}, []
    names = {name: None for name in model.state_dict()}
    try:
        transforms = rules["mapping"](model) or []
    except (ValueError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{folder}: transformers' conversion rules for {type(model).__name__} "
                              f"fail ({str(err).splitlines()[0][:200]})") from None
    renamings = [t for t in transforms if isinstance(t, rules["renaming"])]
    converters = [t for t in transforms if isinstance(t, rules["converter"])]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = model.base_model_prefix
    plain: dict[str, StoredTensor] = {}
    fused: dict[str, tuple[Any, dict[str, list[StoredTensor]]]] = {}
    unexpected = []
    for key in sorted(stored, key=rules["key"]):  # transformers' order: experts 0, 1, ..., 10
        renamed, pattern = rules["rename"](key, renamings, converters, prefix, names)
        if renamed not in names and key in names:
            renamed, pattern = rules["rename"](key, [], [], prefix, names)
        if renamed not in names:
            unexpected.append(key)
        elif pattern is None:
            plain.setdefault(renamed, stored[key])
        else:
            _, collected = fused.setdefault(renamed, (by_pattern[pattern], defaultdict(list)))
            collected[pattern].append(stored[key])
    out = {name: Source(name, [Read(s)], s.shape, s.dtype) for name, s in plain.items()}
    for layer, (converter, collected) in fused.items():
        for source in _fused_sources(rules, model, layer, converter, dict(collected), folder):
            out.setdefault(source.name, source)
    position = {(s.path, s.offset): i for i, s in enumerate(stored.values())}  # the files' order
    first = {name: min(position[r.stored.path, r.stored.offset] for r in s.reads) for name, s in out.items()}
    return dict(sorted(out.items(), key=lambda item: first[item[0]])), unexpected


def _fused_sources(rules, model: nn.Module, layer: str, converter, collected: dict[str, list[StoredTensor]],
                   folder: Path) -> list[Source]:
    """The model tensors one converter makes from the stored tensors `collected` (by source pattern):
    one placed by blocks, or each output of transformers' own convert (shapes from a meta run)."""
    everything = [s for stored in collected.values() for s in stored]
    dtypes = {s.dtype for s in everything}
    if len(dtypes) != 1:
        raise CheckpointError(f"{folder}: the tensors converted into {layer} have several dtypes "
                              f"{sorted(map(str, dtypes))}: re-save the checkpoint")
    (dtype,) = dtypes
    block = _placed(rules, converter, collected, layer, folder)
    if block is not None:
        return [Source(layer, block.reads, block.shape, dtype)]
    reads = [Read(s) for s in everything]
    try:
        outputs = _run(converter, collected, layer, model, dtype, meta=True)
    except Exception as err:  # any failure of a third-party conversion on meta tensors
        raise CheckpointError(
            f"{folder}: transformers' conversion into {layer} ({type(converter).__name__} with "
            f"{[type(op).__name__ for op in converter.operations]}) cannot run tensor by tensor "
            f"({type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}); load the "
            "model with transformers and call weightstream.offload on it") from None
    found = []
    for name, tensor in outputs.items():
        found.append(Source(name, reads, tuple(tensor.shape), dtype, converter, collected, layer, model))
    return found
