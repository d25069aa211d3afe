"""The user's handle on one offloaded model (`OffloadHandle`), and offloading one nn.Module
(`offload_module`: plan, fill the host arena, point every tensor at its place, install the engine).

It finds the repeated blocks, plans what stays resident on the device (`plan.py`), moves the rest into
one exact-size pinned host arena, turns every streamed tensor into a permanent view of a static GPU
slot (or, for zero-copy blocks, of the arena itself), and gives each streamed block a subclass whose
forward runs the two schedule ops around it. The model stays an ordinary `nn.Module`.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from .config import OffloadConfig
from .devices import resolve_device
from .engine import coded_experts, expert_cache, guards
from .engine.engine import StreamEngine
from .engine.experts import ChoiceCounter, ExpertCounter, RoutedBlock
from .engine.host import HostArena
from .engine.streamed import _blocked_apply, _install_schedule
from .engine.uva import uva_view
from .errors import OffloadStateError
from .formats.disk import DiskTier
from .placement.entries import _set_tensor
from .placement.experts import fit_routing_skew, routers
from .placement.plan import Placement, placement_of
from .placement.prepare import Prepared, _plain, final_places, prepare
from .placement.probe import load_profile
from .sizes import format_size
from .wire.groups import encode_groups, fill_arena

_HANDLE_ATTR = "_weightstream_handle"


@dataclass(frozen=True)
class OffloadStats:
    """What an offload placed where. Sizes in bytes.

    `streamed_bytes` stream through the staging slots; `uva_bytes` are read in place (zero copy).
    `requested_strategy` is what offload was asked for ("auto", "stream", "uva"); `placement_kind` what
    the planner chose ("resident", "stream", "uva" or "mix"). Counts since offload: `copies`
    (asynchronous group copies), `prologues` (passes entered with nothing prefetched: the first block
    of a forward, or the first call after a CUDA graph capture or replay), `misses` (waits whose group
    was not prefetched because the run order differed from the learned one; each costs one group's
    copy time) and `misses_last_pass`.

    `wire_bytes` are what one forward moves host->device for the streamed groups, disk-tier groups
    included (a compressed group's blob, else its layout), `wire_raw_bytes` the same groups' layouts.
    `disk_bytes` are the disk-tier groups' raw tensor bytes, `disk_wire_bytes` what one forward reads
    from disk for them (compressed blobs from the cache file, `disk_cache_bytes` in all, plus the raw
    tensors of groups that did not shrink).

    `expert_bytes_per_token`: for a mixture of experts whose routed experts are off the GPU, the expert
    bytes read over the link per token (zero-copy experts the tokens reached, streamed expert groups
    whole; experts held coded for expert copies at their blobs' mean size) since
    `handle.count_experts()` put the routers' counters on; None without them. Blocks
    with a GPU expert cache count the rows their caches read from host memory instead, and
    `expert_hit_rate` is the share of the experts reached that were in the cache.
    """

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
    prologues: int
    misses: int
    misses_last_pass: int
    placement_kind: str
    requested_strategy: str
    predicted_ms: float | None  # the planner's ms per forward in a loop of forwards (eager or compiled)
    wire_bytes: int = 0  # bytes a forward moves over the link for the streamed groups (compressed or not)
    wire_raw_bytes: int = 0  # the same groups' bytes in their layout (what the slots receive)
    disk_wire_bytes: int = 0  # bytes a forward reads from disk (compressed blobs and raw tensors)
    disk_cache_bytes: int = 0  # size of the disk tier's compressed cache file
    # the planner's ms of a forward entered with nothing staged: the first, or a CUDA graph replay
    predicted_first_ms: float | None = None
    expert_bytes_per_token: float | None = None  # counted since count_experts(); None: not counted
    # the GPU expert cache (placement.expert_cache): its pools and work buffers' bytes (with expert
    # copies, placement.expert_copies: their work buffers'), and its hits over the experts reached
    # since offload or count_experts() (None: no cache, or nothing reached)
    cache_bytes: int = 0
    expert_hit_rate: float | None = None
    expert_wire_ratio: float | None = None  # coded expert copies: bytes held and copied over raw bytes

    @property
    def disk_ratio(self) -> float:
        """Bytes read from disk per forward over the disk groups' raw bytes (1.0 when none is coded)."""
        return self.disk_wire_bytes / self.disk_bytes if self.disk_bytes else 1.0

    @property
    def wire_ratio(self) -> float:
        """Wire bytes over raw bytes of the streamed groups (1.0 when nothing is compressed)."""
        return self.wire_bytes / self.wire_raw_bytes if self.wire_raw_bytes else 1.0

    def __str__(self) -> str:
        cuda = self.device.startswith("cuda")  # the CPU backend copies synchronously, into CPU buffers
        return (
            f"device {self.device}: resident {format_size(self.resident_bytes)}, "
            f"streamed {format_size(self.streamed_bytes)} in {self.groups} groups, "
            f"zero copy {format_size(self.uva_bytes)}, "
            f"staging {format_size(self.staging_bytes)} in {self.slots} "
            f"{'slots' if cuda else 'staging buffers'}, "
            f"pinned {format_size(self.pinned_bytes)}, read from disk {format_size(self.disk_wire_bytes)} "
            f"of {format_size(self.disk_bytes)}; "
            f"{self.copies} {'async' if cuda else 'synchronous'} copies, {self.prologues} pass prologues, "
            f"{self.misses} misses "
            f"({self.misses_last_pass} in the last pass); placement {self.placement_kind} "
            f"(asked for {self.requested_strategy}); "
            f"wire {format_size(self.wire_bytes)} of {format_size(self.wire_raw_bytes)} "
            f"(ratio {self.wire_ratio:.3f})"
        )


class OffloadHandle:
    """The user's handle on one offloaded model. Get it from `offload()`; `restore()` undoes the
    offload, `edit()` edits its weights, `stats` counts its bytes and copies.

    Attributes: `model`, `device`, `placement` (the `Placement`), `streamed_blocks` and `uva_blocks`
    (the names of the blocks streamed through the slots, group by group, and read in place),
    `engine` (the `StreamEngine` the schedule ops call during a forward), `config` (the
    `OffloadConfig` it was offloaded with; None for `from_pretrained`).
    """

    def __init__(self, prep: Prepared, engine: StreamEngine) -> None:
        self.model = prep.model
        self.device = prep.device
        self.placement = prep.placement
        self.streamed_blocks = engine.names
        self.uva_blocks = [prep.block_names[i] for i in prep.placement.uva]
        self.engine = engine
        self._streamed_modules: list[nn.Module] = []
        self._patched: list[nn.Module] = []
        self.config: OffloadConfig | None = None  # set by offload_module (edit() offloads with it again)
        self._cost = prep.cost
        self._blocks = prep.block_modules
        self._experts: ExpertCounter | None = None  # count_experts()
        self._choices: ChoiceCounter | None = None  # count_experts(): every router's choices
        self.expert_caches: expert_cache.ExpertCaches | None = None  # the GPU expert cache (finish)
        self.restored = False

    def settle(self) -> list[str]:
        """Adopt every streamed tensor the model rebound since its last forward; return the names of
        those written in place outside any block's forward (`StreamEngine.settle`)."""
        return self.engine.settle()

    # --- user-facing -----------------------------------------------------------------------------
    @property
    def stats(self) -> OffloadStats:
        """Bytes resident, streamed, staged and pinned; groups, slots and copy counts."""
        p = self.placement
        streamed = sum(e.nbytes for g in self.engine.groups for e, _ in g)
        uva = sum(e.nbytes for g in self.engine.uva_groups for e, _ in g)
        disk = self.engine.transfer.disk
        return OffloadStats(
            device=str(self.device),
            resident_bytes=sum(e.nbytes for e in self.engine.entries) - streamed - uva,
            streamed_bytes=streamed,
            uva_bytes=uva,
            staging_bytes=p.staging_bytes,
            pinned_bytes=self.engine.arena.pinned_bytes + self.engine.transfer.extra_pinned_bytes,
            disk_bytes=disk.nbytes if disk is not None else 0,
            disk_wire_bytes=disk.wire_bytes if disk is not None else 0,
            disk_cache_bytes=disk.cache.nbytes if disk is not None and disk.cache is not None else 0,
            groups=len(self.engine.groups),
            slots=p.n_slots,
            copies=self.engine.schedule.copies,
            prologues=self.engine.schedule.prologues,
            misses=self.engine.schedule.misses,
            misses_last_pass=self.engine.schedule.misses_last_pass,
            placement_kind=p.kind,
            requested_strategy=p.requested_strategy,
            predicted_ms=p.prediction.again_ms if p.prediction else None,
            predicted_first_ms=p.prediction.ms if p.prediction else None,
            wire_bytes=sum(enc.wire_bytes if enc else size
                           for enc, size in zip(self.engine.wire, self.engine.group_bytes, strict=True)),
            wire_raw_bytes=sum(self.engine.group_bytes),
            expert_bytes_per_token=self._experts.bytes_per_token() if self._experts else None,
            cache_bytes=self.expert_caches.nbytes if self.expert_caches else 0,
            expert_hit_rate=self.expert_caches.hit_rate() if self.expert_caches else None,
            expert_wire_ratio=self.expert_caches.wire_ratio() if self.expert_caches else None,
        )

    def count_experts(self, on: bool = True) -> None:
        """Count the expert bytes a mixture of experts reads over the link (`stats.expert_bytes_per_token`)
        from now on, or (`on=False`) stop. A forward hook on each router of a block whose routed experts
        are off the GPU (zero copy or streamed) adds the experts its tokens reached to counters on the
        device: no host synchronization per forward (reading `stats` synchronizes), and nothing at all
        while off. Turning it on again starts from zero. It also counts how often each router chose
        each expert, which `routing_skew()` fits."""
        if self._experts is not None:
            self._experts.remove()
            self._experts = None
        if self._choices is not None:
            self._choices.remove()
            self._choices = None
        if not on:
            return
        self._choices = ChoiceCounter([r for m in self._blocks for _, r in routers(m)], self.device)
        experts = self._cost.experts
        in_place = [0] * len(self._blocks)
        streamed = [0] * len(self._blocks)
        for groups, into in ((self.engine.uva_groups, in_place), (self.engine.groups, streamed)):
            for group in groups:
                for entry, _ in group:
                    if experts and len(entry.shape) == 3 and entry.shape[0] == experts:
                        into[entry.owner] += entry.nbytes
        if self.expert_caches is not None:  # experts held coded cross the link as their blobs
            for c in self.expert_caches.caches:
                if isinstance(c, coded_experts.CodedCopy):
                    i = next(i for i, m in enumerate(self._blocks) if any(s is c.module for s in m.modules()))
                    in_place[i] += c.wire_bytes - c.row_bytes * c.experts
        # blocks behind a cache: their caches count what they read (copied experts are counted here)
        caches = self.expert_caches if self.expert_caches and not self.expert_caches.copies else None
        cached = set(caches.blocks) if caches else set()
        blocks = [RoutedBlock(m, experts, in_place[i], streamed[i]) for i, m in enumerate(self._blocks)
                  if (in_place[i] or streamed[i]) and i not in cached]
        if caches:
            caches.reset_counts()
        self._experts = ExpertCounter(blocks, self.device, caches)

    def routing_skew(self) -> float | None:
        """The Zipf exponent of expert popularity that best fits the routers' choices since
        `count_experts()` (`placement.experts.fit_routing_skew`, 0 to 4 in steps of 0.05; 0: uniform):
        run real prompts, then plan a GPU expert cache for that routing with
        `handle.restore(); ws.offload(model, ..., routing_skew=handle_skew)`. None without counting,
        before the routers made 4 choices per expert on average (a few decode steps say little), or
        for a model without routers. Reading it synchronizes."""
        shares = self._choices.shares() if self._choices is not None else None
        return None if shares is None else fit_routing_skew(shares, self._choices.top_k)

    def check_editable(self) -> None:
        """OffloadStateError where `edit()` would refuse: nested, restored, or loaded by from_pretrained."""
        if self.__dict__.get("_editing"):
            raise OffloadStateError(
                "edit() inside edit(): edits cannot be nested. Inside the outer `with handle.edit():` every "
                "weight is already a plain CPU tensor: edit it there")
        if self.restored:
            raise OffloadStateError("this handle was restored: offload the model again to edit it offloaded")
        if self.config is None:
            raise OffloadStateError(
                "edit() needs a model offloaded by weightstream.offload(); for one loaded with "
                "from_pretrained: handle.restore('cpu'), edit, then weightstream.offload(model, ...)")

    @contextlib.contextmanager
    def edit(self):
        """Edit the offloaded model's weights: `with handle.edit(): model.merge_adapter()`.

        Inside the block the model is restored to the CPU: every weight is a plain CPU tensor, true and
        writable (PEFT merge_adapter/unmerge_adapter, diffusers fuse_lora/unfuse_lora and
        load_lora_weights, fusing a norm into a linear, `w.mul_(s)` under no_grad). On leaving it the
        model is offloaded again with the arguments `offload()` was given (the same placement where
        no block changed size, else the same blocks resized, or, where those no longer fit the budget,
        planned anew with a warning), and this handle becomes the new offload's. The edits run on the
        CPU, where offloaded weights live: the result equals the resident model edited on the CPU.
        Host memory must hold the whole model while inside; compiled
        or captured forwards must be compiled or captured again. Where the block raises, the model
        stays restored on the CPU (this handle is then restored). Yields the model.
        """
        self.check_editable()
        asked = self.config.replace(
            keep_resident=tuple(dict.fromkeys((*self.config.keep_resident, *self.engine.state_names))))
        config = asked
        self.restore("cpu")
        self._editing = True
        try:
            yield self.model
        finally:
            self._editing = False
        empty = Placement((), 0, 0, 0, 0)
        cost = prepare(self.model, config.replace(gpu_memory=0, placement=empty), predict_wire=False).cost
        old = self._cost
        p = self.placement
        if (cost.block_bytes, cost.tensor_bytes, cost.slot_bytes) == (old.block_bytes, old.tensor_bytes,
                                                                       old.slot_bytes):
            config = config.replace(placement=p)
        else:  # blocks changed size: the same blocks streamed and read in place, slots resized (None:
            # that no longer fits the budget, and the planner places the model anew)
            if p.compressed or p.copy_landing_bytes:  # its landing buffers: the codec's predicted sizes
                cost = prepare(self.model, config.replace(gpu_memory=0, placement=empty, compress=True),
                               predict_wire=True).cost
            config = config.replace(placement=placement_of(
                cost, p.streamed, p.n_slots, p.uva, p.part, tokens=config.tokens,
                profile=config.profile or load_profile(self.device), budget=self.engine.budget,
                strategy=p.requested_strategy, compressed=p.compressed,
                landing_buffers=p.landing_buffers or None, uva_experts=p.uva_experts,
                expert_cache=p.expert_cache, expert_slots=p.expert_slots, expert_copies=p.expert_copies,
                coded_copies=bool(p.copy_landing_bytes)))
            if config.placement is None:
                warnings.warn(
                    f"weightstream: the edit resized the model's blocks and its placement ({p.kind}: "
                    f"{len(p.streamed)} blocks streamed, {len(p.uva)} read in place, {len(p.expert_copies)} "
                    f"copying their experts, {len(p.expert_cache)} caching them) no longer fits gpu_memory="
                    f"{format_size(self.engine.budget)}: the planner places the model anew (see "
                    "handle.placement). Offload with more gpu_memory to keep it", stacklevel=3)
        new = offload_module(self.model, config)
        new.config = asked  # what was asked; the placement kept (or resized) is an edit's, not the user's
        self.__dict__.clear()
        self.__dict__.update(new.__dict__)  # the new offload's engine, placement and guards
        object.__setattr__(self.model, _HANDLE_ATTR, self)

    def restore(self, device: str | torch.device | None = None) -> nn.Module:
        """Put every weight back as a plain tensor on `device` (default: the offload device), remove the
        schedule ops (the blocks get their own classes back), and free the slots and the host arena.
        Returns the model."""
        if self.restored:
            raise OffloadStateError("this handle was already restored")
        target = self.device if device is None else resolve_device(device)
        engine = self.engine
        for name in self.settle():
            warnings.warn(f"weightstream: {name} was written in place outside its block's forward while "
                          "offloaded; that write went to a staging buffer and is not in the restored model "
                          "(edit weights inside `with handle.edit():`)", stacklevel=2)
        engine.transfer.synchronize()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for block in self._streamed_modules:
            block.__class__ = type(block).__mro__[1]
            del block._ws_engine_id, block._ws_group
        for module in self._patched:
            del module._apply
        self.count_experts(False)
        if self.expert_caches:
            self.expert_caches.remove()
        engine.guards.remove()  # after this, parameters() would read the slots: none is read below
        object.__delattr__(self.model, _HANDLE_ATTR)
        engine.transfer.close()
        for g, group in enumerate(engine.groups + engine.uva_groups):
            region = engine.transfer.raw_group(g) if g < len(engine.groups) else engine.zero_copy_bytes(g)
            for entry, sl in group:
                raw = region[sl.offset : sl.offset + sl.nbytes]
                _set_tensor(entry, entry.copy_of(raw, target))
        off_device = {id(e) for g in engine.groups + engine.uva_groups for e, _ in g}
        for entry in engine.entries:
            if id(entry) not in off_device and entry.tensor.device != target:
                _set_tensor(entry, entry.moved(target))
        engine.close()
        self.restored = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return self.model

    def __repr__(self) -> str:
        return f"OffloadHandle({self.stats})"


def handle_of(model: nn.Module) -> OffloadHandle:
    """The handle of a model offloaded by `offload` or `from_pretrained`."""
    handle = getattr(model, _HANDLE_ATTR, None)
    if handle is None:
        raise OffloadStateError("this model is not offloaded by weightstream")
    return handle


def finish(
    prep: Prepared,
    arena: HostArena,
    places: dict[int, torch.Tensor],
    disk: DiskTier | None = None,
    pin: bool = True,
    check: bool = False,
) -> OffloadHandle:
    """Point every tensor at its final place (streamed ones at their GPU slot views), install the
    schedule and return the handle. `places` must hold every resident and host-streamed entry's bytes
    by now; groups in `disk` are read from their files each forward. `check`: see `offload`."""
    placement = prep.placement
    off_device = {id(e) for group in prep.host_groups for e, _ in group}
    for entry in prep.entries:
        if id(entry) not in off_device:
            _set_tensor(entry, places[id(entry)])
    regions, host_regions = [], []
    for j, group in enumerate(prep.uva_groups):  # zero copy: the device reads the arena in place
        region = arena.region(len(prep.groups) + j)
        host_regions.append(region)
        if prep.device.type == "cuda":
            region = uva_view(region, prep.device)
        regions.append(region)
        if j in prep.coded_experts:
            continue  # its experts are held coded: `install` points them at the work buffers
        for entry, sl in group:
            _set_tensor(entry, entry.view_of(region[sl.offset : sl.offset + sl.nbytes]))
    # cached or copied experts: their parameters view work buffers
    caches = expert_cache.install(prep, regions, host_regions, prep.coded_experts)
    slots = [
        torch.empty(placement.slot_bytes, dtype=torch.uint8, device=prep.device)
        for _ in range(placement.n_slots)
    ]
    for g, group in enumerate(prep.groups):
        slot = slots[g % placement.n_slots]
        for entry, sl in group:
            view = entry.view_of(slot[sl.offset : sl.offset + sl.nbytes])
            if entry.flat is None and not isinstance(view, nn.Parameter):
                view = view.data  # its own version counter, not the slot's (watch.py), as a parameter has
            _set_tensor(entry, view)

    engine = StreamEngine(prep, arena, slots, disk, pin, check)
    handle = OffloadHandle(prep, engine)
    handle.expert_caches = caches
    engine.guards = guards.ModelGuards(engine, prep.model)  # gradients off, eval mode, true state dicts
    if caches:
        caches.watch_host(arena.buffer, engine.guards)
    _install_schedule(engine, prep.block_modules, handle._streamed_modules)
    for module in prep.model.modules():
        module._apply = types.MethodType(_blocked_apply, module)
        handle._patched.append(module)
    object.__setattr__(prep.model, _HANDLE_ATTR, handle)
    if prep.device.type == "cuda":
        torch.cuda.synchronize(prep.device)
        torch.cuda.empty_cache()
    return handle


@torch.inference_mode(False)  # the engine's tensors need version counters, even when offloaded in one
def offload_module(model: nn.Module, config: OffloadConfig) -> OffloadHandle:
    """Offload one nn.Module in place as `config` says (`weightstream.offload` documents each field)."""
    prep = prepare(model, config)
    pin = config.pin_memory and prep.device.type == "cuda"
    sizes, coded = prep.host_group_bytes, frozenset()
    if prep.placement.compressed:
        plain = [all(_plain(e) for e, _ in group) for group in prep.groups]  # subclasses stream raw
        prep.wire = encode_groups(prep.groups, prep.group_bytes, prep.placement.landing_bytes, prep.device,
                                  only=plain)
        sizes = [enc.wire_bytes if enc else size
                 for enc, size in zip(prep.wire, prep.group_bytes, strict=True)] + prep.uva_group_bytes
        coded = frozenset(g for g, enc in enumerate(prep.wire) if enc is not None)
    coded_uva = expert_cache.coded_groups(prep)
    if coded_uva:  # routed experts held coded, one record per expert
        landing = prep.placement.copy_landing_bytes
        groups = [coded_experts.sources(prep.uva_groups[j]) for j in coded_uva]
        group_bytes = [prep.uva_group_bytes[j] for j in coded_uva]
        layouts = coded_experts.size_groups(groups, group_bytes, landing, prep.device)
        prep.coded_experts = dict(zip(coded_uva, layouts, strict=True))
        n = len(prep.groups)
        sizes = list(sizes)
        for j, records in prep.coded_experts.items():
            sizes[n + j] = sum(r.nbytes for r in records)
        coded = coded | {n + j for j in coded_uva}
    arena = HostArena(sizes, pin=pin, device=prep.device)
    if prep.wire:
        prep.wire = fill_arena(arena, prep.wire, prep.groups, prep.device)
    if coded_uva:
        regions = [arena.region(len(prep.groups) + j) for j in coded_uva]
        coded_experts.fill_groups(regions, groups, group_bytes, layouts, landing, prep.device)
    places = final_places(prep, arena, keep_on_device=True, disk_groups=coded)  # coded: in the blobs
    streamed = {id(e) for group in prep.host_groups for e, _ in group}
    # Off-device tensors first, each old storage dropped at once, so a model already on the GPU never
    # holds more than it did before; then the resident ones that must move to the device.
    for entry in sorted(prep.entries, key=lambda e: id(e) not in streamed):
        target = places.get(id(entry))
        if target is None:  # its group is compressed: its bytes are in the arena's blob already
            _set_tensor(entry, torch.empty(0, dtype=entry.dtype))
            continue
        if entry.is_at(target):
            continue  # already in its final place
        entry.copy_to(target)
        if id(entry) in streamed:
            _set_tensor(entry, torch.empty(0, dtype=entry.dtype))
    handle = finish(prep, arena, places, pin=pin, check=config.check)
    handle.config = config
    return handle
