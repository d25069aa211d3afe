"""The stream engine: what the schedule ops call during a forward (`ops.py`): the slot pool, the
transfer that fills it, the schedule that orders the copies, and the watch over tensors the model
writes. One per offloaded model; the user's `OffloadHandle` (`weightstream/offload.py`) owns it and
reads its counters for `stats`.

A block's window: `wait(group)` makes the group's weights ready in its slot, the block computes,
`release(group)` starts the copy of the next group that uses the slot. Between the two the engine's
lock is held, so two threads' blocks never interleave.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import BudgetError, OffloadStateError
from ..placement.entries import Entry, _set_tensor, module_blocks
from ..sizes import format_size
from ..wire.groups import make_transfer
from . import coded_experts, ops, replay
from .host import HostArena
from .schedule import Schedule
from .watch import REBOUND, TensorWatch, Watched, _at, holds_again, peft_layers

if TYPE_CHECKING:
    from ..placement.prepare import Prepared

LOCK_TIMEOUT_S = 300.0  # how long a thread waits for another thread's block before it gives up


class StreamEngine:
    """Streams one offloaded model's groups through its slots. Built by `offload.finish`; registered
    with the ops (`engine_id`) until `close()`.

    Attributes the handle and the guards read: `device`, `placement`, `names` (the streamed blocks'
    names, group by group), `entries`, `groups` and `uva_groups` (each a list of (entry, slice)),
    `arena`, `slots`, `schedule`, `transfer`, `wire` (each group's encoding or None), `group_bytes`,
    `budget`, `state_bytes` and `state_names` (tensors the model writes, kept resident since),
    `guards` (the model's `ModelGuards`, set by `finish`).
    """

    def __init__(self, prep: Prepared, arena: HostArena, slots: list[torch.Tensor], disk=None,
                 pin: bool = True, check: bool = False) -> None:
        self.device = prep.device
        self.placement = prep.placement
        self.names = [prep.block_names[i] for i in prep.placement.streamed]
        self.entries = prep.entries
        self.groups = prep.groups
        self.uva_groups = prep.uva_groups
        # coded expert copies: zero-copy group j -> (its members at offload, its experts' records)
        self.coded_experts = {j: (list(prep.uva_groups[j]), records)
                              for j, records in prep.coded_experts.items()}
        self.uva_group_bytes = prep.uva_group_bytes
        self.arena = arena
        self.arena_version = arena.buffer._version  # moves when a tensor parameters() gave is written
        self.slots = slots
        self.slot_storages = {s.untyped_storage().data_ptr() for s in slots}
        self.schedule = Schedule(len(prep.groups), prep.placement.n_slots)
        self.wire = prep.wire or [None] * len(prep.groups)
        self.group_bytes = prep.group_bytes
        self.transfer = make_transfer(arena, slots, prep.device, disk, pin, prep.wire,
                                      prep.placement.landing_bytes, prep.placement.n_landing)
        self.warned = False
        self.capturing = False  # whether the last op ran inside a CUDA graph capture
        self.lock = threading.Lock()
        self.owner: int | None = None  # thread id holding the lock
        self.budget = prep.budget
        self.state_bytes = 0  # bytes of streamed tensors the model writes, kept resident since
        self.state_names: list[str] = []  # their names (edit() keeps them resident when it offloads again)
        # the streamed groups' tensors, then the zero-copy groups' (group len(groups) + j: as the arena
        # and the guards number them); a zero-copy tensor is its true memory, so a write to it is one to
        # the weight, as on the resident model, and only its rebinding matters (routed experts behind a
        # GPU expert cache or expert copies view work buffers instead: their caches refuse a write,
        # `expert_cache.ExpertCaches.gather`)
        self.watch = TensorWatch(prep.groups + prep.uva_groups)
        # tensors kept off the GPU the model rebound, adopted: (group, record, slice); one bound again (as
        # torch.func.functional_call puts the originals back) streams again (`_restream_returned`)
        self.rebound: list[tuple[int, Watched, object]] = []
        # the block of each module: a module holding a streamed tensor registered in another block is
        # refused (`check_registered`)
        self.block_of = module_blocks(prep.block_modules)
        self.refused: BudgetError | None = None  # a state write refused: every later forward is too
        self.peft = peft_layers(prep.model, {id(e.tensor) for group in prep.groups for e, _ in group})
        self.check = check
        self.guards = None
        self.engine_id = ops.register(self)
        _install_process_hooks()  # the last engine closed or dropped takes them off
        weakref.finalize(self, _take_off_process_hooks)  # a model dropped without restore()

    # --- the schedule, called from the custom ops -------------------------------------------------
    def wait(self, group: int) -> None:
        """Make group `group`'s weights ready in its slot before its block computes."""
        if self.refused is not None:  # a state write the budget could not hold: the model is not exact
            raise BudgetError(
                f"an earlier forward of this offloaded model was refused, and its blocks' state is not the "
                f"resident model's since: {self.refused.args[0]}. Call handle.restore() and offload again",
                self.refused.minimum_bytes)
        self._enter()
        try:
            self.transfer.check_capture()
            capturing = self.transfer.capturing()
            if capturing != self.capturing:  # a capture began or ended: its copies ran not / not yet
                self.capturing = capturing
                self._invalidate()
            self._outside_writes(group)
            plan = self.schedule.on_wait(group, capturing)
            for slot, g in plan.copies:  # every group of the prologue first, then what goes ahead
                self.transfer.start_copy(slot, g)
            for _, g in plan.copies:
                self._copy_ahead(g, capturing)
            self.transfer.wait(plan.slot)
            if self.check and not capturing:
                self._verify(group, "before")
            if plan.changed and not self.warned:  # only a miss is ever `changed`
                self.warned = True
                warnings.warn(
                    f"weightstream: block {self.names[group]} ran out of the learned order; "
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
            if self.check and not self.capturing:
                self._verify(group, "after")
        except BaseException:
            self._invalidate()
            self._leave()
            raise
        plan = self.schedule.on_release(group, self.capturing)
        for slot, g in plan.copies:  # every copy first, then what goes ahead, as a prologue does
            self.transfer.start_copy(slot, g)
        for _, g in plan.copies:
            self._copy_ahead(g, self.capturing)
        if plan.join:
            self.transfer.join()
        self._leave()

    def unalias(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """`tensors`, each that shares memory with a staging slot copied (the eager ops pass the rest
        through): a block's input or output must not change when the next group lands in its slot."""
        return [t.clone() if t.untyped_storage().data_ptr() in self.slot_storages else t for t in tensors]

    # --- tensors the model writes (watch.py) -------------------------------------------------------
    def _inside_writes(self, group: int) -> None:
        """At `group`'s release: a tensor of the group its block wrote in place is state, not a weight:
        it moves to resident storage (from the slot, which holds the write until the next copy), within
        the budget; one its block rebound is adopted."""
        for w, change in self.watch.changes(group):
            if change == REBOUND:
                self._unstream(group, w, None)
                continue
            entry = w.entry
            left = self.budget - self.placement.gpu_bytes - self.state_bytes
            if self.capturing:
                raise OffloadStateError(
                    f"{entry.name} is written by block {self.names[group]} while a CUDA graph is "
                    "captured: weightstream keeps a tensor the model writes resident, which it cannot do "
                    "inside a capture. Run one forward before capturing (it moves the tensor then)")
            if entry.nbytes > left:
                self.refused = BudgetError(
                    f"{entry.name} ({format_size(entry.nbytes)}) is written by block "
                    f"{self.names[group]} in its forward: it is state, not a weight, so it must "
                    f"stay on {self.device}, but the budget has {format_size(max(left, 0))} left: offload "
                    f"with gpu_memory >= {format_size(self.budget - left + entry.nbytes)}",
                    self.budget - left + entry.nbytes)
                raise self.refused
            self.state_bytes += entry.nbytes
            self.state_names.append(entry.name)
            self._unstream(group, w, w.tensor.detach().clone())
            warnings.warn(
                f"weightstream: {entry.name} ({format_size(entry.nbytes)}) is written in place by block "
                f"{self.names[group]}: it is state, not a weight, so it stays on {self.device} "
                f"from now on instead of streaming ({format_size(self.state_bytes)} of the "
                f"{format_size(self.budget)} budget kept for such tensors)", stacklevel=2)

    def _outside_writes(self, group: int) -> None:
        """At a wait: streamed tensors changed outside every block's window (between forwards, by the
        user or a library). Checked for every group where a forward begins (and at every wait in check
        mode), else for `group`'s. A rebinding is adopted; an in-place write landed in whichever group
        the slot held, so it is discarded (the slots are refilled) and refused with an error."""
        full = self.check or self.schedule.pass_start in (None, group)
        if full:
            self._restream_returned()
        if full and self.arena.buffer._version != self.arena_version:
            # the host copy was written through a tensor parameters() or state_dict() gave (a view of it,
            # as a resident model's are of its weights): refill the slots from it
            self.arena_version = self.arena.buffer._version
            self._invalidate()
        lost = self.guards.lost_writes() if full and self.guards is not None else []
        if lost:
            self._invalidate()
            raise OffloadStateError(
                f"{lost[0]} was written in place through the tensor parameters() or state_dict() gave for "
                "it while offloaded; its group is compressed or read from disk, so that tensor was a copy "
                "and the write never reached the weights (they are as they were). To edit weights, do it "
                "inside `with handle.edit():` or before offload()")
        if full and self._peft_changed():
            raise OffloadStateError(self._undo_peft() + " To merge adapters, do it inside `with "
                                    "handle.edit():` or before offload()")
        written = self._adopt_rebound(self.watch.all_changes() if full
                                      else [(group, w, c) for w, c in self.watch.changes(group)])
        if not written:
            return
        self._invalidate()
        for w in written:
            self.watch.accept(w)
        w = written[0]
        kind = "parameter" if isinstance(w.tensor, nn.Parameter) else "buffer"
        what = f"{kind} {w.entry.name} was written in place"
        raise OffloadStateError(
            f"{what} outside its block's forward while offloaded. A streamed tensor is a view of a staging "
            "buffer that other blocks share, so the write went to whichever block's weights the buffer "
            "held and was discarded (the tensors are as they were before it). To edit weights (PEFT "
            "merge_adapter, diffusers fuse_lora, w.mul_(s)), do it inside `with handle.edit():` or before "
            "offload(). If a compiled forward wrote it (torch.compile applies a block's in-place writes "
            "after the block's window), it is state: run one forward eagerly before compiling, and "
            "weightstream keeps it resident")

    def _peft_changed(self) -> list[nn.Module]:
        """The PEFT tuner layers over streamed weights whose merged adapters changed since offload (or
        since they were adopted)."""
        return [m for m, merged in self.peft.items() if list(m.merged_adapters) != merged]

    def _undo_peft(self) -> str:
        """Undo a PEFT merge or unmerge made outside every block's forward: its `.data` writes landed
        in whichever group a slot held (discarded: the slots are refilled), a `safe_merge` rebound the
        weight to a copy made from such a slot (pointed back at its slot), and the layers' lists of
        merged adapters go back to what they were, so weights and adapters agree again. Returns what
        happened, for an error or a warning."""
        layers = self._peft_changed()
        for g, w, change in self.watch.all_changes():
            if g >= len(self.groups):
                continue  # zero copy: the arena is the weights' memory; left to `_adopt_rebound`
            if change == REBOUND and all(_at(site) is w.tensor for site in w.entry.sites):
                self.watch.revert(w)  # `.data = merged copy`: back to its slot
            elif change != REBOUND:
                self.watch.accept(w)  # written in place: discarded with the slots' bytes
        for m in layers:
            m.merged_adapters[:] = self.peft[m]
        self._invalidate()
        return (f"PEFT adapters were merged into or unmerged from {len(layers)} {type(layers[0]).__name__} "
                "layers' weights outside their blocks' forwards while offloaded. A streamed weight is a view "
                "of a staging buffer that other blocks share, so the merge read and wrote whichever "
                "block's weights the buffer held; it was undone (the weights and the layers' merged "
                "adapters are as they were before it).")

    def _unstream(self, group: int, w: Watched, value: torch.Tensor | None) -> None:
        """Stop streaming `w`'s entry: it becomes resident at `value` (None: at what the model bound in
        its place). Its bytes stay in the group's layout, unread."""
        entry = w.entry
        members = self._members(group)
        if value is None:  # rebound: adopted, unless the model binds this tensor again
            self.rebound.extend((group, w, sl) for e, sl in members if e is entry)
        members[:] = [(e, sl) for e, sl in members if e is not entry]
        self.watch.drop(group, w)
        self.guards.forget(w.tensor)
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
        self._restream_returned()
        if self._peft_changed():
            warnings.warn("weightstream: " + self._undo_peft() + " Merge adapters inside `with "
                          "handle.edit():`.", stacklevel=3)
        return [w.entry.name for w in self._adopt_rebound(self.watch.all_changes())]

    def _restream_returned(self) -> None:
        """Stream again each adopted tensor whose original the model holds again at every site (a
        temporary swap: torch.func.functional_call, a context manager that puts weights back): its bytes
        never left the group's layout, so only the records come back."""
        for item in list(self.rebound):
            group, w, sl = item
            if holds_again(w):
                self.rebound.remove(item)
                w.entry.tensor = w.tensor
                self._members(group).append((w.entry, sl))
                self.watch.restore(group, w)
                self.guards.remember_true(w.tensor, (w.entry, group, sl))

    def zero_copy_bytes(self, group: int) -> torch.Tensor:
        """Zero-copy group `group`'s bytes in its layout (numbered after the streamed groups, as the arena
        numbers them): its arena region, or for routed experts held coded, a host copy decoded from it."""
        j = group - len(self.groups)
        if j not in self.coded_experts:
            return self.arena.region(group)
        members, records = self.coded_experts[j]
        return coded_experts.raw_group(self.arena.region(group), members, self.uva_group_bytes[j], records)

    def _members(self, group: int) -> list:
        """The (entry, slice) list of `group` as the watch numbers groups: streamed, then zero copy."""
        n = len(self.groups)
        return self.groups[group] if group < n else self.uva_groups[group - n]

    def _adopt_rebound(self, found: list[tuple[int, Watched, str]]) -> list[Watched]:
        """Adopt each rebound tensor of `found` ((group, watched, change) triples, as
        `TensorWatch.all_changes` gives them); return the streamed ones written in place instead (a
        write to a zero-copy tensor went to its true memory, the pinned arena: taken as it is)."""
        written = []
        for g, w, change in found:
            if change == REBOUND:
                self._unstream(g, w, None)
            elif g >= len(self.groups):
                self.watch.accept(w)
            else:
                written.append(w)
        return written

    def _verify(self, group: int, when: str) -> None:
        """Check mode: the slot of `group` holds each of its tensors' bytes (`when`: "before" or "after"
        the block ran)."""
        raw = self.transfer.raw_group(group)
        slot = self.slots[self.schedule.slot(group)]
        for entry, sl in self.groups[group]:
            got = slot[sl.offset : sl.offset + sl.nbytes]
            if not torch.equal(got, raw[sl.offset : sl.offset + sl.nbytes].to(got.device)):
                raise OffloadStateError(
                    f"weightstream check: {when} block {self.names[group]} ran, its staging slot "
                    f"does not hold {entry.name}'s bytes: something wrote streamed memory "
                    + ("between forwards (through .data, which no version counter sees)" if when == "before"
                       else "in the block's forward without an in-place op that torch tracks (.data)"))

    def _copy_ahead(self, group: int, capturing: bool) -> None:
        """After `group` was started into its slot: send the bytes of the group the schedule offers
        ahead of its slot, where the transfer can (a compressed group's blob into a free landing
        buffer), and tell the schedule when it did."""
        nxt = self.schedule.ahead(group, capturing)
        if nxt is not None and self.transfer.copy_ahead(nxt):
            self.schedule.sent(nxt)

    def abort(self) -> None:
        """A block raised between its wait and its release: free the engine for other threads. The
        slots' bookkeeping stays true (nothing was copied behind its back)."""
        self._leave()

    def on_graph_event(self, synchronize: bool = False) -> None:
        """A CUDA graph capture begins or ends, or a replay starts (`replay.py`): join the copies in
        flight (`synchronize`: before a capture, wait for them on the host) and forget what the slots
        hold."""
        if synchronize:
            self.transfer.synchronize_idle()
        self.transfer.join_for_graph()
        self.transfer.forget_events()
        self._invalidate()

    def _invalidate(self) -> None:
        """Forget what the slots and landing buffers hold."""
        self.schedule.invalidate()
        self.transfer.forget()

    def _enter(self) -> None:
        """Serialize blocks across threads: two threads' blocks never interleave inside one block."""
        me = threading.get_ident()
        if self.owner == me:
            return  # this thread's last block raised inside a compiled graph before its release
        if not self.lock.acquire(timeout=LOCK_TIMEOUT_S):
            raise OffloadStateError(
                f"weightstream: another thread has held this offloaded model for {LOCK_TIMEOUT_S:.0f} s "
                "inside one block (a compiled forward that raised part-way leaves it held): call the "
                "model from one thread at a time, or offload one copy of it per thread"
            )
        self.owner = me

    def _leave(self) -> None:
        if self.owner == threading.get_ident():
            self.owner = None
            self.lock.release()

    def close(self) -> None:
        """Free the slots and the host arena and leave the ops' registry (after `restore` read the
        true bytes back)."""
        self.slots.clear()
        self.watch = TensorWatch([])  # its records alias the slots and the arena: let them go
        self.rebound = []
        self.arena.close()
        ops.unregister(self.engine_id)
        _take_off_process_hooks()

    def adopt_modules(self, module: nn.Module) -> None:
        """`module` was just registered inside the offloaded model (PEFT injecting LoRA layers after
        offload, `load_lora_weights`): watch its tuner layers over streamed weights from now on, with the
        adapters they have merged now, so a later merge (through `.data`) is refused as one from before."""
        streamed = {id(e.tensor) for group in self.groups for e, _ in group}
        for layer, merged in peft_layers(module, streamed).items():
            self.peft.setdefault(layer, merged)
        if self.guards is not None:
            self.guards.guard_peft(module)

    def streamed_entry(self, tensor: torch.Tensor) -> Entry | None:
        """The entry of `tensor` where it is a streamed tensor (a view of a staging slot), else None."""
        found = self.guards._true.get(id(tensor)) if self.guards is not None else None
        if found is None or found[1] >= len(self.groups) or found[0].tensor is not tensor:
            return None  # not kept off the GPU, or read in place (zero copy: its own host bytes)
        return found[0]

    def check_registered(self, parent: nn.Module, name: str, module: nn.Module) -> None:
        """`module` is being registered as `parent.<name>` inside the offloaded model: refuse it where it
        holds a tensor streamed with another block than `parent`'s (it would be read outside that
        block's forward, from a slot other groups share); else its modules join `parent`'s block."""
        if parent._modules.get(name) is module:
            return
        block = self.block_of.get(id(parent))
        for sub in module.modules():
            for tensor in (*sub._parameters.values(), *sub._buffers.values()):
                entry = self.streamed_entry(tensor)
                if entry is not None and entry.owner != block:
                    raise OffloadStateError(
                        f"{entry.name} streams through a staging buffer that other blocks share: "
                        f"registering a module that holds it as {type(parent).__name__}.{name}, outside "
                        "its own block, would read it there. Share modules, or drop, reorder or "
                        "replace blocks (model.layers = model.layers[:n]), before offload() or inside "
                        "`with handle.edit():`")
        if block is not None:
            for sub in module.modules():
                self.block_of[id(sub)] = block


# The process-wide hooks, installed while any engine is open, in this one place: torch.cuda.CUDAGraph's
# capture and replay (`replay.py`) and nn.Module's global submodule-registration hook (modules added
# to an offloaded model are watched: `StreamEngine.adopt_modules`).
_registration: list[torch.utils.hooks.RemovableHandle] | None = None


def _on_module_registered(parent, name: str, module):
    """nn.Module's global registration hook: a submodule set on a module of an offloaded model."""
    guards = parent.__dict__.get("_ws_guards")
    if guards is not None and isinstance(module, nn.Module):
        if not torch.compiler.is_compiling():
            guards.engine.check_registered(parent, name, module)
        guards.engine.adopt_modules(module)
    return None


def _on_tensor_registered(module: nn.Module, name: str, tensor):
    """nn.Module's global parameter and buffer registration hooks: a streamed tensor (a view of a
    staging slot) may be bound again only where it lives (torch.func.functional_call puts it back);
    anywhere else (weights tied after offload, a parametrization such as weight_norm taking it as
    its `original`) it would be read outside its block's forward, so it is refused."""
    if torch.compiler.is_compiling():  # a compiled block rebinding its own buffer: nothing to check
        return None
    for engine in ops.engines():
        streamed_entry = getattr(engine, "streamed_entry", None)  # other engines stream no slot views
        entry = streamed_entry(tensor) if streamed_entry is not None else None
        if entry is None:
            continue
        if not any(site.module is module and site.name == name for site in entry.sites):
            raise OffloadStateError(
                f"{entry.name} streams through a staging buffer that other blocks share: registering it "
                f"as {type(module).__name__}.{name} as well (weights tied after offload, a "
                "parametrization such as weight_norm) would read it outside its block's forward. Do "
                "this before offload(), or inside `with handle.edit():`")
    return None


def _install_process_hooks() -> None:
    global _registration
    replay.install()
    if _registration is None:
        register = nn.modules.module
        _registration = [register.register_module_module_registration_hook(_on_module_registered),
                         register.register_module_parameter_registration_hook(_on_tensor_registered),
                         register.register_module_buffer_registration_hook(_on_tensor_registered)]


def _take_off_process_hooks() -> None:
    """Take the process-wide hooks off where no engine is left: after the last restore, torch is as it
    was. Not the registration hook while torch.compile is tracing (an engine collected by the garbage
    collector in the middle of a trace): the trace may have guarded on the hooks it saw, and removing
    one before its guards are built fails the compile (KeyError in dynamo); a later restore or offload
    takes it off."""
    global _registration
    if not ops.engines():
        replay.uninstall()
        if _registration is not None and torch._guards.TracingContext.try_get() is None:
            for hook in _registration:
                hook.remove()
            _registration = None


def process_hooks_installed() -> bool:
    """Whether any process-wide hook of weightstream is installed now."""
    return replay.installed() or _registration is not None
