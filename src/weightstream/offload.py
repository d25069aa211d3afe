"""`offload(model, gpu_memory=...)`: the in-place transform that makes a model stream its weights.

It finds the repeated blocks, plans what stays resident on the device (`plan.py`), moves the rest into
one exact-size pinned host arena, turns every streamed tensor into a permanent view of a static GPU
slot (or, for zero-copy blocks, of the arena itself), and gives each streamed block a subclass whose
forward runs the two schedule ops around it. The model stays an ordinary `nn.Module`.
"""

from __future__ import annotations

import threading
import types
import warnings
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import nn

from . import guards, kinds, ops, replay, subclass
from .blocks import find_blocks
from .codec import choose
from .cost import ModelCost, largest
from .disk import DiskTier
from .errors import ArgumentError, OffloadStateError, WeightstreamError
from .host import HostArena
from .layout import Slice, pack
from .plan import Placement, plan
from .probe import MachineProfile, load_profile
from .schedule import Schedule
from .sizes import format_size, parse_size
from .uva import uva_view
from .wire import encode_groups, fill_arena, make_transfer

_HANDLE_ATTR = "_weightstream_handle"
LOCK_TIMEOUT_S = 300.0  # how long a thread waits for another thread's block before it gives up


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
    name: str = ""  # qualified name of its first site, for messages

    def __post_init__(self) -> None:
        self.shape = tuple(self.tensor.shape)
        self.dtype = self.tensor.dtype
        # a wrapper subclass (torchao) is stored as its inner tensors' bytes (subclass.py); None: plain
        self.flat = kinds.check(self.tensor, self.name or "a tensor")
        self.nbytes = self.flat.nbytes if self.flat else self.tensor.numel() * self.tensor.element_size()
        self.bf16_bytes = kinds.bf16_bytes(self.tensor, self.nbytes)  # what a bf16 GEMM would read

    def view_of(self, raw: torch.Tensor) -> torch.Tensor:
        """View `raw` (uint8 bytes of exactly this tensor) as this tensor: its dtype and shape, or its
        subclass rebuilt over views of `raw`."""
        if self.flat:
            return self.flat.view_of(raw)
        return kinds.with_class_of(self.tensor, raw.view(self.dtype).view(self.shape))

    def empty(self, device: torch.device) -> torch.Tensor:
        """A new uninitialized tensor like this one on `device`."""
        if self.flat:
            return self.flat.empty(device)
        return kinds.with_class_of(self.tensor, torch.empty(self.shape, dtype=self.dtype, device=device))

    def own(self) -> torch.Tensor:
        """This tensor as its own final place (it stays where it is)."""
        return self.tensor if self.flat else self.tensor.detach()

    def is_at(self, place: torch.Tensor) -> bool:
        """True when `place` is this tensor's own memory (nothing to copy)."""
        if self.flat:
            return place is self.tensor
        return place.device == self.tensor.device and place.data_ptr() == self.tensor.data_ptr()

    def copy_to(self, place: torch.Tensor) -> None:
        """Copy this tensor's values into `place` (one of `view_of` / `empty`), inner tensors included."""
        if self.flat:
            subclass.copy_leaves(place, self.tensor)
        else:
            place.copy_(self.tensor.detach())

    def copy_of(self, raw: torch.Tensor, device: torch.device) -> torch.Tensor:
        """This tensor rebuilt from its bytes `raw` into new memory on `device`."""
        if self.flat:
            return self.flat.copy_of(raw, device)
        return self.view_of(raw).to(device, copy=True)

    def moved(self, device: torch.device) -> torch.Tensor:
        """A copy of this tensor on `device`."""
        if not self.flat:
            return self.tensor.to(device)
        place = self.empty(device)
        self.copy_to(place)
        return place


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
            f"{self.copies} async copies, {self.prologues} pass prologues, {self.misses} misses "
            f"({self.misses_last_pass} in the last pass); placement {self.placement_kind} "
            f"(asked for {self.requested_strategy}); "
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
    for module_name, module in model.named_modules():
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
                qualified = f"{module_name}.{name}" if module_name else name
                entries[id(tensor)] = Entry(tensor, [site], owner if streamable else None, qualified)
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
    for entry in entries:
        site = entry.sites[0]
        if entry.tensor.is_meta and not allow_meta:
            raise OffloadStateError(
                f"{type(site.module).__name__}.{site.name} is on the meta device: load the weights first "
                "(e.g. from_pretrained, or model.to_empty() and a state dict)"
            )


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ArgumentError(f"device={device!r}: give 'cuda', 'cuda:N' or 'cpu'") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise WeightstreamError(
                f"device={device} asked for, but CUDA is not available here: use device='cpu'"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ArgumentError(f"device={device}: weightstream supports 'cuda' and 'cpu'")
    return device


def _tensor_leaves(tree) -> tuple[list, object, list[int]]:
    """Flatten `tree` (tensors nested in tuples, lists, dicts, dataclasses registered with pytree);
    returns the leaves, the structure and the positions of the tensor leaves."""
    leaves, spec = pytree.tree_flatten(tree)
    return leaves, spec, [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]


def _through(op, tree, engine_id: int, group: int):
    """`tree` with every tensor in it replaced by what `op` returns for it (one call for all)."""
    leaves, spec, where = _tensor_leaves(tree)
    if not where:
        return tree, False
    for i, new in zip(where, op([leaves[i] for i in where], engine_id, group), strict=True):
        leaves[i] = new
    return pytree.tree_unflatten(leaves, spec), True


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
        self._schedule = Schedule(len(prep.groups), prep.placement.n_slots)
        self._wire = prep.wire or [None] * len(prep.groups)
        self._group_bytes = prep.group_bytes
        self._transfer = make_transfer(arena, slots, prep.device, disk, pin, prep.wire,
                                       prep.placement.landing_bytes)
        self._warned = False
        self._capturing = False  # whether the last op ran inside a CUDA graph capture
        self._lock = threading.Lock()
        self._owner: int | None = None  # thread id holding _lock
        self._streamed_modules: list[nn.Module] = []
        self._patched: list[nn.Module] = []
        self.engine_id = ops.register(self)
        replay.install(ops.engines)
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
                self._schedule.invalidate()
            plan = self._schedule.on_wait(group, capturing)
            for slot, g in plan.copies:
                self._transfer.start_copy(slot, g)
            self._transfer.wait(plan.slot)
            if plan.miss and not self._warned:
                self._warned = True
                warnings.warn(
                    f"weightstream: block {self.streamed_blocks[group]} ran out of the learned order; "
                    "its weights were copied when it was called (correct, but slower) and the new order "
                    "is learned. handle.stats.misses counts such waits. Warned once per model.",
                    stacklevel=2,
                )
        except BaseException:
            self._schedule.invalidate()  # copies may have been half started
            self._leave()
            raise

    def release(self, group: int) -> None:
        """After group `group` computed: start the copy of the next group that uses its slot."""
        plan = self._schedule.on_release(group, self._capturing)
        if plan.copy is not None:
            self._transfer.start_copy(*plan.copy)
        if plan.join:
            self._transfer.join()
        self._leave()

    def abort(self) -> None:
        """A block raised between its wait and its release: free the engine for other threads. The
        slots' bookkeeping stays true (nothing was copied behind its back)."""
        self._leave()

    def on_graph_event(self) -> None:
        """A CUDA graph capture begins or ends, or a replay starts (`replay.py`): join the copies in
        flight and forget what the slots hold."""
        self._transfer.join_for_graph()
        self._schedule.invalidate()

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
            prologues=self._schedule.prologues,
            misses=self._schedule.misses,
            misses_last_pass=self._schedule.misses_last_pass,
            placement_kind=p.kind,
            requested_strategy=p.requested_strategy,
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


def _set_tensor(entry: Entry, value: torch.Tensor) -> None:
    """Point every site of `entry` at `value` (parameters keep their identity, except meta ones, which
    are replaced at every site by one new parameter, as are wrapper subclasses: their inner tensors
    are Python attributes, which `.data =` would not move)."""
    if entry.flat is not None and value is entry.tensor:
        return
    if isinstance(entry.tensor, nn.Parameter) and not entry.tensor.is_meta and entry.flat is None:
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
    routed = tuple(sum(e.nbytes for e in group if len(e.shape) == 3 and e.shape[0] == experts)
                   for group in per_block) if experts else ()
    quant = tuple(sum(e.nbytes for e in group if e.bf16_bytes != e.nbytes) for group in per_block)
    quant_bf16 = tuple(sum(e.bf16_bytes for e in group if e.bf16_bytes != e.nbytes) for group in per_block)
    tensor_wire = tuple(tuple(_wire_nbytes(e) for e in group) for group in per_block) if wire else ()
    return ModelCost(sum(outside), max(outside, default=0), block_bytes, tuple(slot_bytes), width,
                     tensor_bytes, routed if any(routed) else (), experts, top_k,
                     quant if any(quant) else (), quant_bf16 if any(quant) else (), tensor_wire)


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
    profile: MachineProfile | None = None,
    host_bytes: int | None = None,
    placement: Placement | None = None,
    compress: bool | str = False,
) -> Prepared:
    """Check the model and plan what stays on `device`, what streams and what is read in place
    (zero copy); moves nothing yet.

    allow_meta: accept parameters on the meta device (a model built empty, to be filled from a
    checkpoint straight into its final places). strategy, tokens, profile, placement, compress: see
    `offload`. host_bytes: host memory for the offloaded weights (see `plan.plan`; None: no limit).
    """
    budget = parse_size(gpu_memory)
    device = _resolve_device(device)
    if not isinstance(model, nn.Module):
        raise ArgumentError(f"offload() takes an nn.Module, got {type(model).__name__}")
    if profile is not None and not isinstance(profile, MachineProfile):
        raise ArgumentError(
            f"profile={type(profile).__name__}: give a weightstream.MachineProfile (e.g. "
            "weightstream.REFERENCE_PROFILE, or MachineProfile.from_json of a `weightstream probe` cache)"
        )
    found = find_blocks(model, blocks)
    block_modules = [b.module for b in found]
    entries = _collect(model, block_modules)
    _check_model(model, entries, allow_meta)

    per_block: list[list[Entry]] = [[] for _ in found]
    for entry in entries:
        if entry.owner is not None:
            per_block[entry.owner].append(entry)
    layouts = [pack([e.nbytes for e in group]) for group in per_block]
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ArgumentError(f"tokens={tokens!r}: give the tokens per forward to optimize for, an int >= 1")
    if strategy == "uva" and device.type == "cuda" and not pin_memory:
        raise ArgumentError("strategy='uva' reads pinned host memory in place: it needs pin_memory=True")
    if compress not in (True, False, "auto"):
        raise ArgumentError(f"compress={compress!r}: choose True, False or 'auto'")
    if compress == "auto" and device.type != "cuda" and not allow_meta:
        compress = False  # no link to save on the CPU backend (a plan from sizes alone keeps "auto")
    cost = model_cost(entries, per_block, [size for _, size in layouts], activation_width(model),
                      expert_routing(model), wire=compress is not False)
    if placement is None:
        profile = load_profile(device) if profile is None else profile
        placement = plan(cost, budget, tokens, profile, strategy, host_bytes=host_bytes, compress=compress)
    elif placement.gpu_bytes > budget or max(placement.streamed + placement.uva, default=-1) >= len(found):
        raise ArgumentError(
            f"the given placement needs {format_size(placement.gpu_bytes)} of GPU memory for blocks up to "
            f"{max(placement.streamed + placement.uva, default=-1)}; the budget is {format_size(budget)} "
            f"and the model has {len(found)} blocks: make it with plan.placement_of for this model"
        )

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
            places[id(entry)] = entry.own()
        else:
            places[id(entry)] = entry.empty(prep.device)
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
    compress: bool | str = False,
) -> OffloadHandle:
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
        (the default) or "auto" (when the planner predicts it faster; never on the CPU backend).
        Outputs stay bit-identical; landing buffers for the compressed bytes count in `gpu_memory`.

    A diffusers pipeline is offloaded as a whole (`pipeline.offload_pipeline`, a `PipelineHandle`).
    """
    from .pipeline import is_pipeline, offload_pipeline

    if is_pipeline(model):  # a diffusers pipeline: one budget over its components (pipeline.py)
        return offload_pipeline(model, gpu_memory, device=device, pin_memory=pin_memory, strategy=strategy)
    prep = prepare(model, gpu_memory, device, blocks, strategy=strategy, tokens=tokens,
                   pin_memory=pin_memory, profile=profile, placement=placement,
                   compress=compress)
    pin = pin_memory and prep.device.type == "cuda"
    sizes, coded = prep.host_group_bytes, frozenset()
    if prep.placement.compressed:
        plain = [all(_plain(e) for e, _ in group) for group in prep.groups]  # subclasses stream raw
        prep.wire = encode_groups(prep.groups, prep.group_bytes, prep.placement.landing_bytes, prep.device,
                                  only=plain)
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
        if entry.is_at(target):
            continue  # already in its final place
        entry.copy_to(target)
        if id(entry) in streamed:
            _set_tensor(entry, torch.empty(0, dtype=entry.dtype))
    return finish(prep, arena, places, pin=pin)
