"""`offload(model, gpu_memory=...)`: the in-place transform that makes a model stream its weights.

It finds the repeated blocks, plans what stays resident on the device (`plan.py`), moves the rest into
one exact-size pinned host arena, turns every streamed tensor into a permanent view of a static GPU
slot (or, for zero-copy blocks, of the arena itself), and gives each streamed block a subclass whose
forward runs the two schedule ops around it. The model stays an ordinary `nn.Module`.
"""

from __future__ import annotations

import types
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from . import ops
from .blocks import find_blocks
from .codec import choose
from .cost import ModelCost, largest
from .disk import DiskTier
from .errors import OffloadStateError, WeightstreamError
from .host import HostArena
from .layout import Slice, pack
from .plan import Placement, plan
from .probe import load_profile
from .schedule import Schedule
from .sizes import format_size, parse_size
from .uva import uva_view
from .wire import encode_groups, fill_arena, make_transfer

_HANDLE_ATTR = "_weightstream_handle"


@dataclass(frozen=True)
class TensorSite:
    """Where a tensor lives in the model: `module.<name>` is a parameter or a buffer."""

    module: nn.Module
    name: str
    is_param: bool

    @property
    def persistent(self) -> bool:
        """True for a parameter or a buffer saved in the state dict (and so in checkpoints)."""
        return self.is_param or self.name not in self.module._non_persistent_buffers_set


@dataclass
class Entry:
    """One distinct tensor (tied copies share one entry) and every site that refers to it."""

    tensor: torch.Tensor
    sites: list[TensorSite]
    owner: int | None  # block index when only that block refers to it, else None (stays resident)

    def __post_init__(self) -> None:
        self.shape = tuple(self.tensor.shape)
        self.dtype = self.tensor.dtype
        self.nbytes = self.tensor.numel() * self.tensor.element_size()

    def view_of(self, raw: torch.Tensor) -> torch.Tensor:
        """View `raw` (uint8 bytes of exactly this tensor) as this tensor's dtype and shape."""
        return raw.view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class OffloadStats:
    """What an offload placed where. Sizes in bytes; copies and fetches count since offload."""

    device: str
    resident_bytes: int
    streamed_bytes: int
    uva_bytes: int
    staging_bytes: int
    pinned_bytes: int
    disk_bytes: int
    groups: int
    slots: int
    copies: int
    fetches: int
    strategy: str
    predicted_ms: float | None
    wire_bytes: int = 0  # bytes a forward moves over the link for the streamed groups (compressed or not)
    wire_raw_bytes: int = 0  # the same groups' bytes in their layout (what the slots receive)

    @property
    def wire_ratio(self) -> float:
        """Wire bytes over raw bytes of the streamed groups (1.0 when nothing is compressed)."""
        return self.wire_bytes / self.wire_raw_bytes if self.wire_raw_bytes else 1.0

    def __str__(self) -> str:
        return (
            f"device {self.device}: resident {format_size(self.resident_bytes)}, "
            f"streamed {format_size(self.streamed_bytes)} in {self.groups} groups, "
            f"zero copy {format_size(self.uva_bytes)}, "
            f"staging {format_size(self.staging_bytes)} in {self.slots} slots, "
            f"pinned {format_size(self.pinned_bytes)}, read from disk {format_size(self.disk_bytes)}; "
            f"{self.copies} async copies, {self.fetches} sync fetches; strategy {self.strategy}; "
            f"wire {format_size(self.wire_bytes)} of {format_size(self.wire_raw_bytes)} "
            f"(ratio {self.wire_ratio:.3f})"
        )


def _collect(model: nn.Module, blocks: list[nn.Module]) -> list[Entry]:
    """Every distinct parameter and buffer of the model, with its sites and owning block."""
    block_of: dict[int, int] = {}
    for i, block in enumerate(blocks):
        for module in block.modules():
            block_of[id(module)] = i
    entries: dict[int, Entry] = {}
    for module in model.modules():
        owner = block_of.get(id(module))
        tensors = [(n, t, True) for n, t in module._parameters.items()]
        tensors += [(n, t, False) for n, t in module._buffers.items()]
        for name, tensor, is_param in tensors:
            if tensor is None:
                continue
            site = TensorSite(module, name, is_param)
            entry = entries.get(id(tensor))
            if entry is None:
                streamable = owner is not None and site.persistent
                entries[id(tensor)] = Entry(tensor, [site], owner if streamable else None)
            else:
                entry.sites.append(site)
                if entry.owner != owner:
                    entry.owner = None  # shared across blocks or with the rest: stays resident
    return list(entries.values())


def _check_model(model: nn.Module, entries: list[Entry], allow_meta: bool) -> None:
    if any(getattr(m.__dict__.get("_apply"), "__func__", None) is _blocked_apply for m in model.modules()):
        raise OffloadStateError(
            "this model (or a submodule) is already offloaded: call handle.restore() before offloading again"
        )
    if model.training:
        raise OffloadStateError("weightstream is for inference: call model.eval() before offload()")
    for entry in entries:
        site = entry.sites[0]
        if entry.tensor.is_meta and not allow_meta:
            raise OffloadStateError(
                f"{type(site.module).__name__}.{site.name} is on the meta device: load the weights first "
                "(e.g. from_pretrained, or model.to_empty() and a state dict)"
            )
        if entry.tensor.requires_grad:
            raise OffloadStateError(
                "weightstream is for inference and the model's parameters require gradients: call "
                "model.requires_grad_(False) before offload()"
            )


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise WeightstreamError(
                f"device={device} asked for, but CUDA is not available here: use device='cpu'"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise WeightstreamError(f"device={device}: weightstream supports 'cuda' and 'cpu'")
    return device


def _find_hidden(value):
    """Return a function that replaces the first tensor in `value` (a tensor, a sequence or a mapping),
    and that tensor; (None, None) when there is none."""
    if isinstance(value, torch.Tensor):
        return (lambda new: new), value
    if isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            if isinstance(item, torch.Tensor):
                return (lambda new, i=i: type(value)((*value[:i], new, *value[i + 1 :]))), item
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, torch.Tensor):

                def put(new, key=key):
                    value[key] = new
                    return value

                return put, item
    return None, None


class OffloadHandle:
    """The state of one offloaded model. Get it from `offload()`; `restore()` undoes the offload.

    Attributes: `model`, `device`, `placement` (the `Placement`), `streamed_blocks` (names).
    """

    def __init__(
        self,
        prep: Prepared,
        arena: HostArena,
        slots: list[torch.Tensor],
        disk: DiskTier | None = None,
        pin: bool = True,
    ) -> None:
        self.model = prep.model
        self.device = prep.device
        self.placement = prep.placement
        self.streamed_blocks = [prep.block_names[i] for i in prep.placement.streamed]
        self._entries = prep.entries
        self._groups = prep.groups
        self._uva_groups = prep.uva_groups
        self._arena = arena
        self._slots = slots
        self._schedule = Schedule(len(prep.groups), prep.placement.n_slots)
        self._wire = prep.wire or [None] * len(prep.groups)
        self._group_bytes = prep.group_bytes
        self._transfer = make_transfer(arena, slots, prep.device, disk, pin, prep.wire,
                                       prep.placement.landing_bytes)
        self._warned = False
        self._streamed_modules: list[nn.Module] = []
        self._patched: list[nn.Module] = []
        self.engine_id = ops.register(self)
        self.restored = False

    # --- the schedule, called from the custom ops -------------------------------------------------
    def wait(self, group: int) -> None:
        """Make group `group`'s weights ready in its slot before its block computes."""
        self._transfer.check_capture()
        plan = self._schedule.on_wait(group)
        for slot in plan.prologue:
            self._transfer.start_copy(slot, slot)
        if plan.hit:
            self._transfer.wait(plan.slot)
            return
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"weightstream: block {self.streamed_blocks[group]} ran out of the planned order; its "
                "weights were fetched synchronously (correct, but slower). Warned once per model.",
                stacklevel=2,
            )
        self._transfer.fetch_now(plan.slot, group)

    def release(self, group: int) -> None:
        """After group `group` computed: start the copy of the next group that uses its slot."""
        nxt = self._schedule.on_release(group)
        if nxt is not None:
            self._transfer.start_copy(self._schedule.slot(group), nxt)
        if self._schedule.is_last(group):
            self._transfer.join()

    # --- user-facing -----------------------------------------------------------------------------
    @property
    def stats(self) -> OffloadStats:
        """Bytes resident, streamed, staged and pinned; groups, slots and copy counts."""
        p = self.placement
        streamed = sum(e.nbytes for g in self._groups for e, _ in g)
        uva = sum(e.nbytes for g in self._uva_groups for e, _ in g)
        return OffloadStats(
            device=str(self.device),
            resident_bytes=sum(e.nbytes for e in self._entries) - streamed - uva,
            streamed_bytes=streamed,
            uva_bytes=uva,
            staging_bytes=p.staging_bytes,
            pinned_bytes=self._arena.pinned_bytes + self._transfer.extra_pinned_bytes,
            disk_bytes=self._transfer.disk.nbytes if self._transfer.disk is not None else 0,
            groups=len(self._groups),
            slots=p.n_slots,
            copies=self._schedule.copies,
            fetches=self._schedule.fetches,
            strategy=p.strategy,
            predicted_ms=p.prediction.ms if p.prediction else None,
            wire_bytes=sum(enc.wire_bytes if enc else size
                           for enc, size in zip(self._wire, self._group_bytes, strict=True)),
            wire_raw_bytes=sum(self._group_bytes),
        )

    def restore(self, device: str | torch.device | None = None) -> nn.Module:
        """Put every weight back as a plain tensor on `device` (default: the offload device), remove the
        schedule ops (the blocks get their own classes back), and free the slots and the host arena.
        Returns the model."""
        if self.restored:
            raise OffloadStateError("this handle was already restored")
        target = self.device if device is None else _resolve_device(device)
        self._transfer.synchronize()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for block in self._streamed_modules:
            block.__class__ = type(block).__mro__[1]
            del block._ws_engine_id, block._ws_group
        for module in self._patched:
            del module._apply
        object.__delattr__(self.model, _HANDLE_ATTR)
        self._transfer.close()
        for g, group in enumerate(self._groups + self._uva_groups):
            region = self._transfer.raw_group(g) if g < len(self._groups) else self._arena.region(g)
            for entry, sl in group:
                raw = region[sl.offset : sl.offset + sl.nbytes]
                value = entry.view_of(raw).to(target, copy=True)
                _set_tensor(entry, value)
        off_device = {id(e) for g in self._groups + self._uva_groups for e, _ in g}
        for entry in self._entries:
            if id(entry) not in off_device and entry.tensor.device != target:
                _set_tensor(entry, entry.tensor.to(target))
        self._slots.clear()
        self._arena.close()
        ops.unregister(self.engine_id)
        self.restored = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return self.model

    def __repr__(self) -> str:
        return f"OffloadHandle({self.stats})"


def _set_tensor(entry: Entry, value: torch.Tensor) -> None:
    """Point every site of `entry` at `value` (parameters keep their identity, except meta ones, which
    are replaced at every site by one new parameter)."""
    if isinstance(entry.tensor, nn.Parameter) and not entry.tensor.is_meta:
        entry.tensor.data = value
        return
    if isinstance(entry.tensor, nn.Parameter):
        value = nn.Parameter(value, requires_grad=False)
        for site in entry.sites:
            site.module._parameters[site.name] = value
        entry.tensor = value
        return
    for site in entry.sites:
        site.module._buffers[site.name] = value
    entry.tensor = value


def _blocked_apply(self, fn, *args, **kwargs):
    raise OffloadStateError(
        f"{type(self).__name__} is offloaded by weightstream: .to()/.cuda()/.half() would break the "
        "streaming views. Call handle.restore() first, then move or cast the model."
    )


_STREAMED_CLASSES: dict[type, type] = {}


def _streamed_forward(self, *args, **kwargs):
    """Forward of a streamed block: wait for its group, compute, release the slot."""
    base = type(self).__mro__[1]
    engine_id, group = self._ws_engine_id, self._ws_group
    replace, hidden = _find_hidden(args)
    if hidden is not None:
        args = replace(ops.wait(hidden, engine_id, group))
    else:
        replace, hidden = _find_hidden(kwargs)
        if hidden is None:
            raise WeightstreamError(
                f"{base.__name__} was called with no tensor argument: weightstream orders its copies "
                "through the block's input hidden state"
            )
        kwargs = replace(ops.wait(hidden, engine_id, group))
    output = base.forward(self, *args, **kwargs)
    replace, hidden = _find_hidden(output)
    if hidden is None:
        raise WeightstreamError(
            f"{base.__name__} returned no tensor: weightstream orders its copies through the block's "
            "output hidden state"
        )
    return replace(ops.release(hidden, engine_id, group))


def _streamed_class(base: type) -> type:
    """A subclass of `base` whose forward runs the schedule ops around the original forward.

    A new class rather than hooks: torch.compile guards on a submodule's type but not on its hooks,
    so a graph compiled for the resident model would otherwise be reused for the offloaded one.
    """
    if base not in _STREAMED_CLASSES:
        _STREAMED_CLASSES[base] = type(f"Streamed{base.__name__}", (base,), {"forward": _streamed_forward})
    return _STREAMED_CLASSES[base]


def _install_schedule(handle: OffloadHandle, blocks: list[nn.Module]) -> None:
    for group, index in enumerate(handle.placement.streamed):
        block = blocks[index]
        block._ws_engine_id, block._ws_group = handle.engine_id, group
        block.__class__ = _streamed_class(type(block))
        handle._streamed_modules.append(block)


def handle_of(model: nn.Module) -> OffloadHandle:
    """The handle of a model offloaded by `offload` or `from_pretrained`."""
    handle = getattr(model, _HANDLE_ATTR, None)
    if handle is None:
        raise OffloadStateError("this model is not offloaded by weightstream")
    return handle


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

    @property
    def host_groups(self) -> list[list[tuple[Entry, Slice]]]:
        """Every group whose bytes live in the host arena: streamed ones, then zero-copy ones."""
        return self.groups + self.uva_groups

    @property
    def host_group_bytes(self) -> list[int]:
        return self.group_bytes + self.uva_group_bytes


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
    routed = tuple(sum(e.nbytes for e in group if len(e.shape) == 3 and e.shape[0] == experts)
                   for group in per_block) if experts else ()
    tensor_wire = tuple(tuple(choose(e.tensor).nbytes for e in group) for group in per_block) if wire else ()
    return ModelCost(sum(outside), max(outside, default=0), block_bytes, tuple(slot_bytes), width,
                     tensor_bytes, routed if any(routed) else (), experts, top_k, tensor_wire)


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


def prepare(
    model: nn.Module,
    gpu_memory: int | str,
    device: str | torch.device | None = None,
    blocks: list[str] | None = None,
    allow_meta: bool = False,
    strategy: str = "auto",
    tokens: int = 1,
    pin_memory: bool = True,
    compress: bool | str = False,
) -> Prepared:
    """Check the model and plan what stays on `device`, what streams and what is read in place
    (zero copy); moves nothing yet.

    allow_meta: accept parameters on the meta device (a model built empty, to be filled from a
    checkpoint straight into its final places). strategy, tokens, compress: see `offload`.
    """
    budget = parse_size(gpu_memory)
    device = _resolve_device(device)
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload() takes an nn.Module, got {type(model).__name__}")
    found = find_blocks(model, blocks)
    block_modules = [b.module for b in found]
    entries = _collect(model, block_modules)
    _check_model(model, entries, allow_meta)

    per_block: list[list[Entry]] = [[] for _ in found]
    for entry in entries:
        if entry.owner is not None:
            per_block[entry.owner].append(entry)
    layouts = [pack([e.nbytes for e in group]) for group in per_block]
    if tokens < 1:
        raise ValueError(f"tokens={tokens}: give the tokens per forward to optimize for, at least 1")
    if strategy == "uva" and device.type == "cuda" and not pin_memory:
        raise ValueError("strategy='uva' reads pinned host memory in place: it needs pin_memory=True")
    if compress not in (True, False, "auto"):
        raise ValueError(f"compress={compress!r}: choose True, False or 'auto'")
    if compress == "auto" and device.type != "cuda" and not allow_meta:
        compress = False  # no link to save on the CPU backend (a plan from sizes alone keeps "auto")
    cost = model_cost(entries, per_block, [size for _, size in layouts], activation_width(model),
                      expert_routing(model), wire=compress is not False)
    placement = plan(cost, budget, tokens, load_profile(device), strategy, compress=compress)

    def grouped(indices, part=0):
        """Each block's (entry, slice) pairs and region size: its `part` largest tensors (0: all)."""
        groups, sizes = [], []
        for i in indices:
            chosen = [per_block[i][j] for j in largest(cost.tensor_bytes[i], part)]
            slices, size = pack([e.nbytes for e in chosen]) if part else layouts[i]
            groups.append(list(zip(chosen, slices, strict=True)))
            sizes.append(size)
        return groups, sizes

    groups, group_bytes = grouped(placement.streamed, placement.part)
    uva_groups, uva_group_bytes = grouped(placement.uva)
    return Prepared(model, device, [b.name for b in found], block_modules, entries, placement, groups,
                    group_bytes, uva_groups, uva_group_bytes, cost)


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
            places[id(entry)] = entry.tensor.detach()
        else:
            places[id(entry)] = torch.empty(entry.shape, dtype=entry.dtype, device=prep.device)
    return places


def finish(
    prep: Prepared,
    arena: HostArena,
    places: dict[int, torch.Tensor],
    disk: DiskTier | None = None,
    pin: bool = True,
) -> OffloadHandle:
    """Point every tensor at its final place (streamed ones at their GPU slot views), install the
    schedule and return the handle. `places` must hold every resident and host-streamed entry's bytes
    by now; groups in `disk` are read from their files each forward."""
    placement = prep.placement
    off_device = {id(e) for group in prep.host_groups for e, _ in group}
    for entry in prep.entries:
        if id(entry) not in off_device:
            _set_tensor(entry, places[id(entry)])
    for j, group in enumerate(prep.uva_groups):  # zero copy: the device reads the arena in place
        region = arena.region(len(prep.groups) + j)
        if prep.device.type == "cuda":
            region = uva_view(region, prep.device)
        for entry, sl in group:
            _set_tensor(entry, entry.view_of(region[sl.offset : sl.offset + sl.nbytes]))
    slots = [
        torch.empty(placement.slot_bytes, dtype=torch.uint8, device=prep.device)
        for _ in range(placement.n_slots)
    ]
    for g, group in enumerate(prep.groups):
        slot = slots[g % placement.n_slots]
        for entry, sl in group:
            _set_tensor(entry, entry.view_of(slot[sl.offset : sl.offset + sl.nbytes]))

    handle = OffloadHandle(prep, arena, slots, disk, pin)
    _install_schedule(handle, prep.block_modules)
    for module in prep.model.modules():
        module._apply = types.MethodType(_blocked_apply, module)
        handle._patched.append(module)
    object.__setattr__(prep.model, _HANDLE_ATTR, handle)
    if prep.device.type == "cuda":
        torch.cuda.synchronize(prep.device)
        torch.cuda.empty_cache()
    return handle


def offload(
    model: nn.Module,
    gpu_memory: int | str,
    *,
    device: str | torch.device | None = None,
    pin_memory: bool = True,
    blocks: list[str] | None = None,
    strategy: str = "auto",
    tokens: int = 1,
    compress: bool | str = False,
) -> OffloadHandle:
    """Offload `model` in place so its weights take at most `gpu_memory` on `device`; return the handle.

    gpu_memory: bytes (int) or a string like "6GiB" / "500MB": resident weights plus staging slots.
        Activations and KV caches are not counted.
    device: "cuda" (default when available) or "cpu" (the synchronous backend: same schedule, no
        streams; used for testing and CPU-only machines).
    pin_memory: page-lock the host arena (fast async copies, CUDA graphs). False streams from
        pageable memory: about 9x slower, no CUDA graph capture.
    blocks: qualified names of the block lists to stream (e.g. ["model.layers"]); found automatically
        by default.
    strategy: "auto" (default: what the cost model predicts fastest), "stream" (copy blocks into
        staging slots ahead of use) or "uva" (kernels read blocks in place from pinned host memory,
        no staging memory).
    tokens: tokens per forward to plan for (1 = batch-1 decode; 2048 for such a prefill).
    compress: stream bf16/fp16 groups losslessly compressed (`codec.py`, about 0.71 of the bytes for
        Hugging Face-initialized bf16 weights) and decode them on the GPU into the slots: True, False
        (the default) or "auto" (when the planner predicts it faster; never on the CPU backend).
        Outputs stay bit-identical; landing buffers for the compressed bytes count in `gpu_memory`.
    """
    prep = prepare(model, gpu_memory, device, blocks, strategy=strategy, tokens=tokens,
                   pin_memory=pin_memory, compress=compress)
    pin = pin_memory and prep.device.type == "cuda"
    sizes, coded = prep.host_group_bytes, frozenset()
    if prep.placement.compressed:
        prep.wire = encode_groups(prep.groups, prep.group_bytes, prep.placement.landing_bytes, prep.device)
        sizes = [enc.wire_bytes if enc else size
                 for enc, size in zip(prep.wire, prep.group_bytes, strict=True)] + prep.uva_group_bytes
        coded = frozenset(g for g, enc in enumerate(prep.wire) if enc is not None)
    arena = HostArena(sizes, pin=pin)
    if prep.wire:
        prep.wire = fill_arena(arena, prep.wire, prep.groups, prep.device)
    places = final_places(prep, arena, keep_on_device=True, disk_groups=coded)  # coded: in the blobs
    streamed = {id(e) for group in prep.host_groups for e, _ in group}
    # Off-device tensors first, each old storage dropped at once, so a model already on the GPU never
    # holds more than it did before; then the resident ones that must move to the device.
    for entry in sorted(prep.entries, key=lambda e: id(e) not in streamed):
        target = places.get(id(entry))
        if target is None:  # its group is compressed: its bytes are in the arena's blob already
            _set_tensor(entry, torch.empty(0, dtype=entry.dtype))
            continue
        if target.device == entry.tensor.device and target.data_ptr() == entry.tensor.data_ptr():
            continue  # already in its final place
        target.copy_(entry.tensor.detach())
        if id(entry) in streamed:
            _set_tensor(entry, torch.empty(0, dtype=entry.dtype))
    return finish(prep, arena, places, pin=pin)
