"""`offload(model, gpu_memory=...)`: the in-place transform that makes a model stream its weights.

It finds the repeated blocks, plans what stays resident on the device (`plan.py`), moves the rest into
one exact-size pinned host arena, turns every streamed tensor into a permanent view of a static GPU
slot (or, for zero-copy blocks, of the arena itself), and gives each streamed block a subclass whose
forward runs the two schedule ops around it. The model stays an ordinary `nn.Module`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import types
import warnings
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from .engine import guards, ops, replay
from .engine.host import HostArena
from .engine.schedule import Schedule
from .engine.streamed import _blocked_apply, _install_schedule
from .engine.uva import uva_view
from .engine.watch import REBOUND, TensorWatch, Watched, peft_layers
from .errors import ArgumentError, BudgetError, OffloadStateError
from .formats.disk import DiskTier
from .placement.entries import _set_tensor
from .placement.plan import Placement, placement_of
from .placement.prepare import Prepared, _plain, _resolve_device, final_places, prepare
from .placement.probe import MachineProfile
from .sizes import format_size
from .wire.groups import encode_groups, fill_arena, make_transfer

if TYPE_CHECKING:
    from .pipeline import PipelineHandle

_HANDLE_ATTR = "_weightstream_handle"
LOCK_TIMEOUT_S = 300.0  # how long a thread waits for another thread's block before it gives up


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

    @property
    def disk_ratio(self) -> float:
        """Bytes read from disk per forward over the disk groups' raw bytes (1.0 when none is coded)."""
        return self.disk_wire_bytes / self.disk_bytes if self.disk_bytes else 1.0

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
            f"pinned {format_size(self.pinned_bytes)}, read from disk {format_size(self.disk_wire_bytes)} "
            f"of {format_size(self.disk_bytes)}; "
            f"{self.copies} async copies, {self.prologues} pass prologues, {self.misses} misses "
            f"({self.misses_last_pass} in the last pass); placement {self.placement_kind} "
            f"(asked for {self.requested_strategy}); "
            f"wire {format_size(self.wire_bytes)} of {format_size(self.wire_raw_bytes)} "
            f"(ratio {self.wire_ratio:.3f})"
        )


class OffloadHandle:
    """The state of one offloaded model. Get it from `offload()`; `restore()` undoes the offload.

    Attributes: `model`, `device`, `placement` (the `Placement`), `streamed_blocks` and `uva_blocks`
    (the names of the blocks streamed through the slots, group by group, and read in place).
    """

    def __init__(
        self,
        prep: Prepared,
        arena: HostArena,
        slots: list[torch.Tensor],
        disk: DiskTier | None = None,
        pin: bool = True,
        check: bool = False,
    ) -> None:
        self.model = prep.model
        self.device = prep.device
        self.placement = prep.placement
        self.streamed_blocks = [prep.block_names[i] for i in prep.placement.streamed]
        self.uva_blocks = [prep.block_names[i] for i in prep.placement.uva]
        self._entries = prep.entries
        self._groups = prep.groups
        self._uva_groups = prep.uva_groups
        self._arena = arena
        self._slots = slots
        self._slot_storages = {s.untyped_storage().data_ptr() for s in slots}
        self._schedule = Schedule(len(prep.groups), prep.placement.n_slots)
        self._wire = prep.wire or [None] * len(prep.groups)
        self._group_bytes = prep.group_bytes
        self._transfer = make_transfer(arena, slots, prep.device, disk, pin, prep.wire,
                                       prep.placement.landing_bytes, prep.placement.n_landing)
        self._warned = False
        self._capturing = False  # whether the last op ran inside a CUDA graph capture
        self._lock = threading.Lock()
        self._owner: int | None = None  # thread id holding _lock
        self._streamed_modules: list[nn.Module] = []
        self._patched: list[nn.Module] = []
        self._budget = prep.budget
        self._state_bytes = 0  # bytes of streamed tensors the model writes, kept resident since
        self._state_names: list[str] = []  # their names (edit() keeps them resident when it offloads again)
        self._watch = TensorWatch(prep.groups)
        self._peft = peft_layers(prep.model, {id(e.tensor) for group in prep.groups for e, _ in group})
        self._check = check
        self._offload_args: dict | None = None  # what offload() was called with (for edit())
        self._cost = prep.cost
        self.engine_id = ops.register(self)
        replay.install()
        self.restored = False

    # --- the schedule, called from the custom ops -------------------------------------------------
    def wait(self, group: int) -> None:
        """Make group `group`'s weights ready in its slot before its block computes."""
        self._enter()
        try:
            self._transfer.check_capture()
            capturing = self._transfer.capturing()
            if capturing != self._capturing:  # a capture began or ended: its copies ran not / not yet
                self._capturing = capturing
                self._invalidate()
            self._outside_writes(group)
            plan = self._schedule.on_wait(group, capturing)
            for slot, g in plan.copies:  # every group of the prologue first, then what goes ahead
                self._transfer.start_copy(slot, g)
            for _, g in plan.copies:
                self._copy_ahead(g, capturing)
            self._transfer.wait(plan.slot)
            if self._check and not capturing:
                self._verify(group, "before")
            if plan.changed and not self._warned:  # only a miss is ever `changed`
                self._warned = True
                warnings.warn(
                    f"weightstream: block {self.streamed_blocks[group]} ran out of the learned order; "
                    "its weights were copied when it was called (correct, but slower) and the new order "
                    "is learned. handle.stats.misses counts such waits. Warned once per model.",
                    stacklevel=2,
                )
        except BaseException:
            self._invalidate()  # copies may have been half started
            self._leave()
            raise

    def release(self, group: int) -> None:
        """After group `group` computed: start the copy of the next group that uses its slot."""
        try:
            self._inside_writes(group)
            if self._check and not self._capturing:
                self._verify(group, "after")
        except BaseException:
            self._invalidate()
            self._leave()
            raise
        plan = self._schedule.on_release(group, self._capturing)
        for slot, g in plan.copies:  # every copy first, then what goes ahead, as a prologue does
            self._transfer.start_copy(slot, g)
        for _, g in plan.copies:
            self._copy_ahead(g, self._capturing)
        if plan.join:
            self._transfer.join()
        self._leave()

    def unalias(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """`tensors`, each that shares memory with a staging slot copied (the eager ops pass the rest
        through): a block's input or output must not change when the next group lands in its slot."""
        return [t.clone() if t.untyped_storage().data_ptr() in self._slot_storages else t for t in tensors]

    # --- tensors the model writes (watch.py) -------------------------------------------------------
    def _inside_writes(self, group: int) -> None:
        """At `group`'s release: a tensor of the group its block wrote in place is state, not a weight:
        it moves to resident storage (from the slot, which holds the write until the next copy), within
        the budget; one its block rebound is adopted."""
        for w, change in self._watch.changes(group):
            if change == REBOUND:
                self._unstream(group, w, None)
                continue
            entry = w.entry
            left = self._budget - self.placement.gpu_bytes - self._state_bytes
            if self._capturing:
                raise OffloadStateError(
                    f"{entry.name} is written by block {self.streamed_blocks[group]} while a CUDA graph is "
                    "captured: weightstream keeps a tensor the model writes resident, which it cannot do "
                    "inside a capture. Run one forward before capturing (it moves the tensor then)")
            if entry.nbytes > left:
                raise BudgetError(
                    f"{entry.name} ({format_size(entry.nbytes)}) is written by block "
                    f"{self.streamed_blocks[group]} in its forward: it is state, not a weight, so it must "
                    f"stay on {self.device}, but the budget has {format_size(max(left, 0))} left: offload "
                    f"with gpu_memory >= {format_size(self._budget - left + entry.nbytes)}",
                    self._budget - left + entry.nbytes)
            self._state_bytes += entry.nbytes
            self._state_names.append(entry.name)
            self._unstream(group, w, w.tensor.detach().clone())
            warnings.warn(
                f"weightstream: {entry.name} ({format_size(entry.nbytes)}) is written in place by block "
                f"{self.streamed_blocks[group]}: it is state, not a weight, so it stays on {self.device} "
                f"from now on instead of streaming ({format_size(self._state_bytes)} of the "
                f"{format_size(self._budget)} budget kept for such tensors)", stacklevel=2)

    def _outside_writes(self, group: int) -> None:
        """At a wait: streamed tensors changed outside every block's window (between forwards, by the
        user or a library). Checked for every group where a forward begins (and at every wait in check
        mode), else for `group`'s. A rebinding is adopted; an in-place write landed in whichever group
        the slot held, so it is discarded (the slots are refilled) and refused with an error."""
        full = self._check or self._schedule.pass_start in (None, group)
        written = self._adopt_rebound(self._watch.all_changes() if full
                                      else [(group, w, c) for w, c in self._watch.changes(group)])
        merged = [m for m, n in self._peft.items() if len(m.merged_adapters) != n] if full else []
        if not written and not merged:
            return
        self._invalidate()
        for w in written:
            self._watch.accept(w)
        for m in merged:
            self._peft[m] = len(m.merged_adapters)
        if written:
            w = written[0]
            kind = "parameter" if isinstance(w.tensor, nn.Parameter) else "buffer"
            what = f"{kind} {w.entry.name} was written in place"
        else:
            what = (f"PEFT adapters were merged into or unmerged from {type(merged[0]).__name__} layers' "
                    "weights")
        raise OffloadStateError(
            f"{what} outside its block's forward while offloaded. A streamed tensor is a view of a staging "
            "buffer that other blocks share, so the write went to whichever block's weights the buffer "
            "held and was discarded (the tensors are as they were before it). To edit weights (PEFT "
            "merge_adapter, diffusers fuse_lora, w.mul_(s)), do it inside `with handle.edit():` or before "
            "offload(). If a compiled forward wrote it (torch.compile applies a block's in-place writes "
            "after the block's window), it is state: run one forward eagerly before compiling, and "
            "weightstream keeps it resident")

    def _unstream(self, group: int, w: Watched, value: torch.Tensor | None) -> None:
        """Stop streaming `w`'s entry: it becomes resident at `value` (None: at what the model bound in
        its place). Its bytes stay in the group's layout, unread."""
        entry = w.entry
        self._groups[group][:] = [(e, sl) for e, sl in self._groups[group] if e is not entry]
        self._watch.drop(group, w)
        self._guards.forget(w.tensor)
        if value is not None:
            _set_tensor(entry, value)
        else:
            bound = w.bound()
            if bound is not None:
                entry.tensor = bound

    def settle(self) -> list[str]:
        """Adopt every streamed tensor the model rebound since the last forward (so `state_dict()` and
        `restore()` see what the model holds); return the names of those written in place outside any
        block's forward (their writes went to staging buffers)."""
        return [w.entry.name for w in self._adopt_rebound(self._watch.all_changes())]

    def _adopt_rebound(self, found: list[tuple[int, Watched, str]]) -> list[Watched]:
        """Adopt each rebound tensor of `found` ((group, watched, change) triples, as
        `TensorWatch.all_changes` gives them); return those written in place instead."""
        written = []
        for g, w, change in found:
            if change == REBOUND:
                self._unstream(g, w, None)
            else:
                written.append(w)
        return written

    def _verify(self, group: int, when: str) -> None:
        """Check mode: the slot of `group` holds each of its tensors' bytes (`when`: "before" or "after"
        the block ran)."""
        raw = self._transfer.raw_group(group)
        slot = self._slots[self._schedule.slot(group)]
        for entry, sl in self._groups[group]:
            got = slot[sl.offset : sl.offset + sl.nbytes]
            if not torch.equal(got, raw[sl.offset : sl.offset + sl.nbytes].to(got.device)):
                raise OffloadStateError(
                    f"weightstream check: {when} block {self.streamed_blocks[group]} ran, its staging slot "
                    f"does not hold {entry.name}'s bytes: something wrote streamed memory "
                    + ("between forwards (through .data, which no version counter sees)" if when == "before"
                       else "in the block's forward without an in-place op that torch tracks (.data)"))

    def _copy_ahead(self, group: int, capturing: bool) -> None:
        """After `group` was started into its slot: send the bytes of the group the schedule offers
        ahead of its slot, where the transfer can (a compressed group's blob into a free landing
        buffer), and tell the schedule when it did."""
        nxt = self._schedule.ahead(group, capturing)
        if nxt is not None and self._transfer.copy_ahead(nxt):
            self._schedule.sent(nxt)

    def abort(self) -> None:
        """A block raised between its wait and its release: free the engine for other threads. The
        slots' bookkeeping stays true (nothing was copied behind its back)."""
        self._leave()

    def on_graph_event(self, synchronize: bool = False) -> None:
        """A CUDA graph capture begins or ends, or a replay starts (`replay.py`): join the copies in
        flight (`synchronize`: before a capture, wait for them on the host) and forget what the slots
        hold."""
        if synchronize:
            self._transfer.synchronize_idle()
        self._transfer.join_for_graph()
        self._transfer.forget_events()
        self._invalidate()

    def _invalidate(self) -> None:
        """Forget what the slots and landing buffers hold."""
        self._schedule.invalidate()
        self._transfer.forget()

    def _enter(self) -> None:
        """Serialize blocks across threads: two threads' blocks never interleave inside one block."""
        me = threading.get_ident()
        if self._owner == me:
            return  # this thread's last block raised inside a compiled graph before its release
        if not self._lock.acquire(timeout=LOCK_TIMEOUT_S):
            raise OffloadStateError(
                f"weightstream: another thread has held this offloaded model for {LOCK_TIMEOUT_S:.0f} s "
                "inside one block (a compiled forward that raised part-way leaves it held): call the "
                "model from one thread at a time, or offload one copy of it per thread"
            )
        self._owner = me

    def _leave(self) -> None:
        if self._owner == threading.get_ident():
            self._owner = None
            self._lock.release()

    # --- user-facing -----------------------------------------------------------------------------
    @property
    def stats(self) -> OffloadStats:
        """Bytes resident, streamed, staged and pinned; groups, slots and copy counts."""
        p = self.placement
        streamed = sum(e.nbytes for g in self._groups for e, _ in g)
        uva = sum(e.nbytes for g in self._uva_groups for e, _ in g)
        disk = self._transfer.disk
        return OffloadStats(
            device=str(self.device),
            resident_bytes=sum(e.nbytes for e in self._entries) - streamed - uva,
            streamed_bytes=streamed,
            uva_bytes=uva,
            staging_bytes=p.staging_bytes,
            pinned_bytes=self._arena.pinned_bytes + self._transfer.extra_pinned_bytes,
            disk_bytes=disk.nbytes if disk is not None else 0,
            disk_wire_bytes=disk.wire_bytes if disk is not None else 0,
            disk_cache_bytes=disk.cache.nbytes if disk is not None and disk.cache is not None else 0,
            groups=len(self._groups),
            slots=p.n_slots,
            copies=self._schedule.copies,
            prologues=self._schedule.prologues,
            misses=self._schedule.misses,
            misses_last_pass=self._schedule.misses_last_pass,
            placement_kind=p.kind,
            requested_strategy=p.requested_strategy,
            predicted_ms=p.prediction.again_ms if p.prediction else None,
            predicted_first_ms=p.prediction.ms if p.prediction else None,
            wire_bytes=sum(enc.wire_bytes if enc else size
                           for enc, size in zip(self._wire, self._group_bytes, strict=True)),
            wire_raw_bytes=sum(self._group_bytes),
        )

    @contextlib.contextmanager
    def edit(self):
        """Edit the offloaded model's weights: `with handle.edit(): model.merge_adapter()`.

        Inside the block the model is restored to the CPU: every weight is a plain CPU tensor, true and
        writable (PEFT merge_adapter/unmerge_adapter, diffusers fuse_lora/unfuse_lora and
        load_lora_weights, fusing a norm into a linear, `w.mul_(s)` under no_grad). On leaving it the
        model is offloaded again with the arguments `offload()` was given (the same placement where
        no block changed size, else planned anew within the same budget), and this handle becomes the
        new offload's. The edits run on the CPU, where offloaded weights live: the result equals the
        resident model edited on the CPU. Host memory must hold the whole model while inside; compiled
        or captured forwards must be compiled or captured again. Where the block raises, the model
        stays restored on the CPU (this handle is then restored). Yields the model.
        """
        if self.restored:
            raise OffloadStateError("this handle was restored: offload the model again to edit it offloaded")
        if self._offload_args is None:
            raise OffloadStateError(
                "edit() needs a model offloaded by weightstream.offload(); for one loaded with "
                "from_pretrained: handle.restore('cpu'), edit, then weightstream.offload(model, ...)")
        args = dict(self._offload_args)
        args["keep_resident"] = tuple(dict.fromkeys((*args["keep_resident"], *self._state_names)))
        self.restore("cpu")
        yield self.model
        empty = Placement((), 0, 0, 0, 0)
        cost = prepare(self.model, 0, args["device"], args["blocks"], placement=empty,
                       predict_wire=False, keep_resident=args["keep_resident"]).cost
        old = self._cost
        p = self.placement
        if (cost.block_bytes, cost.tensor_bytes, cost.slot_bytes) == (old.block_bytes, old.tensor_bytes,
                                                                       old.slot_bytes):
            args["placement"] = p
        else:  # blocks changed size: the same blocks streamed and read in place, slots resized (None:
            # that no longer fits the budget, and the planner places the model anew)
            args["placement"] = placement_of(cost, p.streamed, p.n_slots, p.uva, p.part, budget=self._budget,
                                             strategy=p.requested_strategy, compressed=p.compressed,
                                             landing_buffers=p.landing_buffers or None)
        new = offload(self.model, **args)
        ops.unregister(new.engine_id)
        self.__dict__.clear()
        self.__dict__.update(new.__dict__)
        self.engine_id = ops.register(self)
        for block in self._streamed_modules:
            block._ws_engine_id = self.engine_id
        self._guards.handle = self
        object.__setattr__(self.model, _HANDLE_ATTR, self)

    def restore(self, device: str | torch.device | None = None) -> nn.Module:
        """Put every weight back as a plain tensor on `device` (default: the offload device), remove the
        schedule ops (the blocks get their own classes back), and free the slots and the host arena.
        Returns the model."""
        if self.restored:
            raise OffloadStateError("this handle was already restored")
        target = self.device if device is None else _resolve_device(device)
        for name in self.settle():
            warnings.warn(f"weightstream: {name} was written in place outside its block's forward while "
                          "offloaded; that write went to a staging buffer and is not in the restored model "
                          "(edit weights inside `with handle.edit():`)", stacklevel=2)
        self._transfer.synchronize()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for block in self._streamed_modules:
            block.__class__ = type(block).__mro__[1]
            del block._ws_engine_id, block._ws_group
        for module in self._patched:
            del module._apply
        self._guards.remove()  # after this, parameters() would read the slots: none is read below
        object.__delattr__(self.model, _HANDLE_ATTR)
        self._transfer.close()
        for g, group in enumerate(self._groups + self._uva_groups):
            region = self._transfer.raw_group(g) if g < len(self._groups) else self._arena.region(g)
            for entry, sl in group:
                raw = region[sl.offset : sl.offset + sl.nbytes]
                _set_tensor(entry, entry.copy_of(raw, target))
        off_device = {id(e) for g in self._groups + self._uva_groups for e, _ in g}
        for entry in self._entries:
            if id(entry) not in off_device and entry.tensor.device != target:
                _set_tensor(entry, entry.moved(target))
        self._slots.clear()
        self._arena.close()
        ops.unregister(self.engine_id)
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
    check: bool | None = None,
) -> OffloadHandle:
    """Point every tensor at its final place (streamed ones at their GPU slot views), install the
    schedule and return the handle. `places` must hold every resident and host-streamed entry's bytes
    by now; groups in `disk` are read from their files each forward. `check`: see `offload` (None: the
    environment variable WEIGHTSTREAM_CHECK)."""
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
            view = entry.view_of(slot[sl.offset : sl.offset + sl.nbytes])
            if entry.flat is None and not isinstance(view, nn.Parameter):
                view = view.data  # its own version counter, not the slot's (watch.py), as a parameter has
            _set_tensor(entry, view)

    if check is None:
        check = os.environ.get("WEIGHTSTREAM_CHECK", "") not in ("", "0")
    handle = OffloadHandle(prep, arena, slots, disk, pin, check)
    handle._guards = guards.ModelGuards(handle)  # gradients off, eval mode, true state dicts
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
    profile: MachineProfile | None = None,
    placement: Placement | None = None,
    compress: bool | str = "auto",
    check: bool | None = None,
    keep_resident: Collection[str] = (),
) -> OffloadHandle | PipelineHandle:
    """Offload `model` in place so its weights take at most `gpu_memory` on `device`; return the handle.

    For inference: the model may come as transformers builds it (training mode, parameters requiring
    gradients); offload puts it in eval mode and turns gradients off, and `restore()` puts both back.
    While offloaded, `train()`, `requires_grad_(True)` and autograd raise InferenceOnlyError;
    `state_dict()` and `parameters()` give the true weights; `deepcopy` and pickling refuse.

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
    profile: the machine profile the planner costs placements with (`weightstream.MachineProfile`).
        Default: this GPU's cached profile, measured once (about ten seconds) when absent; the reference
        H200 profile without CUDA. Pass one (e.g. `weightstream.REFERENCE_PROFILE`) and the placement
        depends on the arguments alone, the same on every machine.
    placement: use this placement instead of planning one (`plan.placement_of` makes one from the
        model's cost, `prepare(...).cost`): how tests and tools force the case they need.
    compress: stream bf16/fp16 groups losslessly compressed (`codec.py`, about 0.71 of the bytes for
        Hugging Face-initialized bf16 weights) and decode them on the GPU into the slots: True, False
        or "auto" (the default: compressed wherever the planner predicts it faster, which on the H200
        held for every placement measured, LLMs and a Flux transformer (docs/compression.md); never
        on the CPU backend, and
        never for tensor subclasses, whose groups stream raw). False forces raw groups.
        Outputs stay bit-identical; landing buffers for the compressed bytes count in `gpu_memory`.
    check: after every wait and before every release, compare the block's staging slot with its
        group's true bytes and every streamed tensor's version counter, and raise naming the block and
        the tensor where something wrote streamed memory (slow: a host sync and a copy per block; not
        inside CUDA graph captures). None (default): on where the environment variable
        WEIGHTSTREAM_CHECK is set to anything but "" or "0".
    keep_resident: qualified names of parameters or buffers (as `model.state_dict()` names them) to
        keep on the device, counted in `gpu_memory`: state the model writes (a KV cache in buffers),
        so it is resident from the start, also for a model compiled before its first forward.

    A tensor a block writes in its forward (a buffer it updates in place) is state, not a weight: it
    stays resident from that forward on, counted in `gpu_memory` (a warning names it; BudgetError where
    the budget cannot hold it). A streamed weight written in place from outside its block's forward
    (`w.mul_(s)` after offload) raises OffloadStateError at the next forward: edit weights inside
    `with handle.edit():` (docs/exactness.md).

    A diffusers pipeline is offloaded as a whole (`pipeline.offload_pipeline`, a `PipelineHandle`):
    device, pin_memory, strategy, compress and profile apply to every component; blocks, tokens and
    placement name one model's and are refused (`offload_pipeline(tokens=..., calls=...)` takes them
    per component).
    """
    from .pipeline import is_pipeline, offload_pipeline

    if is_pipeline(model):  # a diffusers pipeline: one budget over its components (pipeline.py)
        given = [name for name, value, default in (("blocks", blocks, None), ("tokens", tokens, 1),
                                                  ("placement", placement, None)) if value != default]
        if given:
            raise ArgumentError(
                f"{', '.join(given)}: offload(pipeline) plans every component itself; call "
                "weightstream.pipeline.offload_pipeline(pipe, ..., tokens={name: n}, calls={name: n}) for "
                "per-component tokens, or offload one component (pipe.transformer) with these arguments")
        return offload_pipeline(model, gpu_memory, device=device, pin_memory=pin_memory, strategy=strategy,
                                compress=compress, profile=profile, check=check)
    prep = prepare(model, gpu_memory, device, blocks, strategy=strategy, tokens=tokens,
                   pin_memory=pin_memory, profile=profile, placement=placement,
                   compress=compress, keep_resident=keep_resident)
    pin = pin_memory and prep.device.type == "cuda"
    sizes, coded = prep.host_group_bytes, frozenset()
    if prep.placement.compressed:
        plain = [all(_plain(e) for e, _ in group) for group in prep.groups]  # subclasses stream raw
        prep.wire = encode_groups(prep.groups, prep.group_bytes, prep.placement.landing_bytes, prep.device,
                                  only=plain)
        sizes = [enc.wire_bytes if enc else size
                 for enc, size in zip(prep.wire, prep.group_bytes, strict=True)] + prep.uva_group_bytes
        coded = frozenset(g for g, enc in enumerate(prep.wire) if enc is not None)
    arena = HostArena(sizes, pin=pin, device=prep.device)
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
        if entry.is_at(target):
            continue  # already in its final place
        entry.copy_to(target)
        if id(entry) in streamed:
            _set_tensor(entry, torch.empty(0, dtype=entry.dtype))
    handle = finish(prep, arena, places, pin=pin, check=check)
    handle._offload_args = dict(gpu_memory=gpu_memory, device=device, pin_memory=pin_memory, blocks=blocks,
                                strategy=strategy, tokens=tokens, profile=profile, placement=placement,
                                compress=compress, check=check, keep_resident=tuple(keep_resident))
    return handle
