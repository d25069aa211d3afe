"""The GPU expert cache: per mixture-of-experts layer, a static pool of expert slots on the device and
an index table (expert -> slot, or -1: in host memory), so hot experts stop crossing the link.

Why this shape: the experts' computation (transformers' grouped_mm, batched_mm or eager loop) reads its
fused 3-D parameters [experts, ...] and only the rows of the experts the tokens are routed to. Before it
runs, `gather` copies exactly those rows into a static work buffer of the parameter's own shape, from
the pool where cached and from the pinned host arena (in place) where not; the parameter is a permanent
view of that buffer. The computation then runs the very ops, on the very shapes and values, the resident
model runs, so its outputs are bit-identical; the rows of experts not routed to are never read. Work
buffers of one shape are shared by every cached layer (they run one after another on one stream).

Every step is device work with static shapes (no host synchronization, no data-dependent sizes): the
table update (`CacheTable.step`) is a few small tensor ops over the experts, the copies one launch per
parameter of `expert_gather.copy_rows` (Triton) whose programs skip rows the table does not name. So a
CUDA graph captures the whole of it, replays keep updating the cache, and addresses never change. Off
CUDA the same copy runs in plain torch (`copy_rows_reference`), so the CPU backend runs the real table.

Policy: while a layer's first `fill_calls` calls run, the cache holds the most frequently routed experts
so far (least frequently used replaced); after that the most recently routed ones (least recently used
replaced). Ties go to an expert already cached, then the more frequent, then the lower index. An expert
never routed to is never cached. By default `fill_calls` is never reached: the cache keeps the most
frequently routed experts throughout. Recency lost to it where slots are few: with 9 slots for a
router choosing 8 of 128 experts from a Zipf(1) popularity, the most recent hold mostly the previous
token's experts and served 0.32 of the reads on an H100 (0.30 with this table on the CPU), the most
frequent 0.444 on an H100 (0.425 on the CPU; the 9 most popular take 0.431); a small `fill_calls`
suits routing that shifts. New experts are copied host -> slot, then slot -> work buffer.

Eagerly, on a GPU, the table update and copies are dozens of small launches per layer that the host
issues one by one (measured on an H100, Qwen3-30B-A3B at 8 GiB: 1.6 ms a layer, decode 1.84x slower
than without the cache, where from a CUDA graph the cache made it 21% faster). So after
`EAGER_WARN_CALLS` forwards run eagerly on a GPU with no CUDA graph capture before them, a warning
says so, once per model.

Under torch.compile the gather is the custom op `weightstream::expert_gather`, which takes the experts'
hidden states and routing and returns copies of them (as the schedule ops of `ops.py` do), so every
read of the parameters follows it; eagerly it is called straight from the forward of the experts
module (`_gathered_class`: a subclass, since torch.compile guards on classes, not hooks).

Expert copies (`ExpertCopy`, placement.expert_copies) use the same work buffers, classes and op without a
pool or table: the host reads the call's routing (one synchronization per layer) and the copy engine
copies the routed experts' rows from the pinned arena into the work buffer, at the link's copy rate
whatever the experts' layout (a GEMM reading GPT-OSS's [experts, in, out] experts in place reads short
rows, at about 0.45 of it on an H100). The synchronization rules out CUDA graphs: a capture is refused.
"""

from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import OffloadStateError
from ..placement.entries import Entry, _set_tensor
from ..placement.experts import is_experts
from ..placement.layout import pack
from . import coded_experts, ops
from .experts import routed_on_host

EAGER_WARN_CALLS = 32  # eager forwards on a GPU, no capture seen, after which the cache warns it costs more
FILL_CALLS = 1 << 40  # calls of a layer during which the cache keeps the most frequent; by default, always
_ID_BITS = 10  # the expert index in the ordering key (up to 1024 experts)
_FREQ_BITS = 24  # routing counts in the key, saturating
_CACHED_SHIFT = _ID_BITS + _FREQ_BITS
_PRIMARY_SHIFT = _CACHED_SHIFT + 1  # 28 bits left: calls or counts saturate at 2**28 - 1
MAX_EXPERTS = 1 << _ID_BITS


def copy_rows_reference(dst: torch.Tensor, src0: torch.Tensor, src1: torch.Tensor, dst_row: torch.Tensor,
                        src_row: torch.Tensor, which: torch.Tensor) -> None:
    """`expert_gather.copy_rows` in plain torch: `dst[dst_row[i]] = (src1 if which[i] else src0)
    [src_row[i]]` for every i with dst_row[i] >= 0 (data-dependent indexing: synchronizes on CUDA)."""
    take = dst_row >= 0
    rows, src, use1 = dst_row[take], src_row[take], which[take].bool()
    dst[rows[use1]] = src1[src[use1]]
    dst[rows[~use1]] = src0[src[~use1]]


def copy_rows(dst: torch.Tensor, src0: torch.Tensor, src1: torch.Tensor, dst_row: torch.Tensor,
              src_row: torch.Tensor, which: torch.Tensor) -> None:
    """The Triton kernel on CUDA, the torch reference elsewhere (same contract, same bytes)."""
    if dst.is_cuda:
        from .expert_gather import copy_rows as kernel

        kernel(dst, src0, src1, dst_row, src_row, which)
    else:
        copy_rows_reference(dst, src0, src1, dst_row, src_row, which)


@dataclass(frozen=True)
class Step:
    """What one call of a layer does, as [experts] device tensors: `routed` (reached by some token),
    `hit` (routed and cached before the call), `admit` (copied host -> slot `slot[e]` in this call)
    and the table after it (`slot`: slot or -1)."""

    routed: torch.Tensor
    hit: torch.Tensor
    admit: torch.Tensor
    slot: torch.Tensor


class CacheTable:
    """The index table of one layer's cache of `slots` experts out of `experts`, and the policy that
    updates it (module docstring), as device tensors updated in place with static shapes.

    `table[e]`: the slot holding expert e, or -1; `owner[s]`: the expert in slot s, or -1 (one entry
    more, written by no slot: the target of masked scatters). `freq[e]`: calls that routed to e;
    `last[e]`: the last such call (1-based); `calls`: calls so far. `counts`: calls, tokens, experts
    reached, hits, rows read from host memory (each a row of every fused tensor of one expert)."""

    def __init__(self, experts: int, slots: int, device: torch.device, fill_calls: int = FILL_CALLS) -> None:
        if not 0 < slots <= experts or experts > MAX_EXPERTS:
            raise ValueError(f"an expert cache holds 1..{experts} slots of at most {MAX_EXPERTS} experts, "
                             f"not {slots} of {experts}")
        self.experts, self.slots, self.fill_calls = experts, slots, fill_calls
        long = dict(dtype=torch.int64, device=device)
        self.table = torch.full((experts,), -1, **long)
        self.owner = torch.full((slots + 1,), -1, **long)
        self.freq = torch.zeros(experts, **long)
        self.last = torch.zeros(experts, **long)
        self.calls = torch.zeros((), **long)
        self.counts = torch.zeros(5, **long)
        self._ids = torch.arange(experts, **long)
        self._slot_ids = torch.arange(slots, **long)
        self._tie = (MAX_EXPERTS - 1) - self._ids  # lower index first

    def routed(self, top_k_index: torch.Tensor) -> torch.Tensor:
        """[experts] bool: the experts some token of `top_k_index` (any shape) is routed to (indices
        past the last expert, as expert parallelism marks foreign ones, are ignored)."""
        flat = top_k_index.reshape(-1).to(torch.int64)
        hit = torch.zeros(self.experts + 1, dtype=torch.bool, device=flat.device)
        hit.index_fill_(0, flat.clamp(0, self.experts), True)
        return hit[: self.experts]

    def step(self, routed: torch.Tensor, tokens: int) -> Step:
        """Account one call that routes `tokens` tokens to the experts of `routed` and update the table:
        the slots then hold the `slots` best experts by the policy's key. Returns what to copy."""
        cap = (1 << (64 - _PRIMARY_SHIFT - 1)) - 1
        self.calls.add_(1)
        self.freq.add_(routed.to(torch.int64))
        self.last.copy_(torch.where(routed, self.calls, self.last))
        cached = self.table >= 0
        primary = torch.where(self.calls <= self.fill_calls, self.freq, self.last).clamp(max=cap)
        key = ((primary << _PRIMARY_SHIFT) | (cached.to(torch.int64) << _CACHED_SHIFT)
               | (self.freq.clamp(max=(1 << _FREQ_BITS) - 1) << _ID_BITS) | self._tie)
        key = torch.where(self.freq > 0, key, -1)
        best = torch.topk(key, self.slots).indices
        desired = torch.zeros_like(cached).index_put_((best,), key[best] >= 0)
        evict, admit = cached & ~desired, desired & ~cached
        owners = self.owner[: self.slots]
        freed = (owners < 0) | evict[owners.clamp(min=0)]
        # the k-th admitted expert (by index) goes to the k-th freed slot (by index)
        by_rank = torch.full_like(self.owner, -1)
        by_rank.scatter_(0, torch.where(freed, freed.cumsum(0) - 1, self.slots), self._slot_ids)
        by_rank.narrow(0, self.slots, 1).fill_(-1)  # fill_ takes -1 as an argument: no host tensor
        new_slot = by_rank[torch.where(admit, admit.cumsum(0) - 1, self.slots)]
        hit = routed & cached
        self.table.copy_(torch.where(admit, new_slot, torch.where(evict, -1, self.table)))
        owners.copy_(torch.where(freed, -1, owners))
        self.owner.scatter_(0, torch.where(admit, new_slot, self.slots), self._ids)
        self.owner.narrow(0, self.slots, 1).fill_(-1)
        host_rows = admit.sum() + (routed & (self.table < 0)).sum()
        self.counts.add_(torch.stack([torch.ones_like(self.calls), torch.full_like(self.calls, tokens),
                                      routed.sum(), hit.sum(), host_rows]))
        return Step(routed, hit, admit, self.table.clone())


@dataclass
class CachedTensor:
    """One fused expert tensor of a cached layer, as rows of bytes [experts, row bytes]: `host` (its
    pinned arena region, a zero-copy view on CUDA), `pool` ([slots, row bytes] on the device) and
    `work` (the static buffer the parameter views)."""

    entry: Entry
    host: torch.Tensor
    pool: torch.Tensor
    work: torch.Tensor


class ExpertCache:
    """The cache of one experts module: its table and its tensors' pools; `gather` before each call."""

    def __init__(self, module: nn.Module, tensors: list[CachedTensor], table: CacheTable) -> None:
        self.module, self.tensors, self.table = module, tensors, table
        self.row_bytes = sum(t.host.shape[1] for t in tensors)  # one expert's bytes in all its tensors
        self.pool_bytes = sum(t.pool.numel() for t in tensors)

    def gather(self, top_k_index: torch.Tensor) -> None:
        """Update the table for this call's routing and copy each routed expert's rows into the work
        buffers: new ones host -> slot first, then cached ones slot -> work, the rest host -> work."""
        table = self.table
        step = table.step(table.routed(top_k_index), top_k_index.reshape(-1, top_k_index.shape[-1]).shape[0])
        ids, none = table._ids, torch.full_like(table._ids, -1)
        admit_to = torch.where(step.admit, step.slot, none)
        cached = step.slot >= 0
        work_to = torch.where(step.routed, ids, none)
        work_from = torch.where(cached, step.slot, ids)
        for t in self.tensors:
            copy_rows(t.pool, t.pool, t.host, admit_to, ids, torch.ones_like(step.admit))
            copy_rows(t.work, t.pool, t.host, work_to, work_from, ~cached)


class ExpertCopy:
    """One experts module whose routed experts the copy engine copies into the work buffers every call
    (no pool, no table): `tensors[i].host` is the pinned arena's rows as the host addresses them."""

    pool_bytes = 0

    def __init__(self, module: nn.Module, tensors: list[CachedTensor], experts: int) -> None:
        self.module, self.tensors, self.experts = module, tensors, experts
        self.row_bytes = sum(t.host.shape[1] for t in tensors)

    def gather(self, top_k_index: torch.Tensor) -> None:
        """Copy the rows of every expert some token of `top_k_index` is routed to (indices outside
        0..experts-1, as expert parallelism marks foreign ones, are skipped), consecutive experts in one
        copy each, on the current stream: after whatever read the shared work buffers before."""
        for start, stop in _runs(routed_on_host(top_k_index, self.experts)):
            for t in self.tensors:
                t.work[start:stop].copy_(t.host[start:stop], non_blocking=True)


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct integers as [start, stop) runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


_CACHES: weakref.WeakValueDictionary[int, ExpertCaches] = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


class ExpertCaches:
    """Every expert cache of one offloaded model: the experts modules' classes that run them
    (`_gathered_class`), their shared work buffers, and what they counted. Built by `offload.finish` from
    the zero-copy groups of the cached blocks; `remove()` gives the modules their classes back (the
    parameters then view the host arena again)."""

    def __init__(self, layers: list[tuple[nn.Module, list[tuple[Entry, torch.Tensor, torch.Tensor]]]],
                 slots: int, device: torch.device, fill_calls: int = FILL_CALLS,
                 coded: dict[int, tuple] | None = None, landing_bytes: int = 0) -> None:
        """`layers`: (experts module, [(entry, its bytes in the host arena as the device reads them, the
        same bytes as the host addresses them)]) of each layer. `slots` 0: expert copies (`ExpertCopy`)
        instead of caches. `coded`: layer index -> (its group's arena region as the host addresses it,
        its `coded_experts.Record`s): those layers' experts are held coded (`coded_experts.CodedCopy`),
        through two landing buffers of `landing_bytes`."""
        self.device = device
        self.copies = slots == 0
        coded = coded or {}
        self.landing = coded_experts.Landing(landing_bytes, device) if coded else None
        self.blocks: tuple[int, ...] = ()  # the model's blocks they cache (set by `install`)
        self.caches: list[ExpertCache] = []
        self.work: dict[tuple, list[torch.Tensor]] = {}  # (shapes, dtypes of a layer) -> work buffers
        self._flat: dict[tuple, torch.Tensor] = {}  # the same -> the one buffer holding them
        # (entry, its tensor viewing the work buffer, that buffer's address, a view of its host bytes)
        self._host_views: list[tuple[Entry, torch.Tensor, int, torch.Tensor]] = []
        for layer, (module, tensors) in enumerate(layers):
            experts = tensors[0][0].shape[0]
            signature = tuple((e.shape, e.dtype) for e, _, _ in tensors)
            if signature not in self.work:  # one buffer, laid out as a zero-copy group of these tensors
                slices, total = pack([e.nbytes for e, _, _ in tensors])
                flat = torch.zeros(total, dtype=torch.uint8, device=device)
                self.work[signature] = [flat[sl.offset : sl.offset + sl.nbytes] for sl in slices]
                self._flat[signature] = flat
            cached = []
            for (entry, host, host_rows), work in zip(tensors, self.work[signature], strict=True):
                row = entry.nbytes // experts
                pool = torch.zeros(slots, row, dtype=torch.uint8, device=device)
                source = host_rows if self.copies else host  # the copy engine takes host addresses
                if layer in coded:  # no rows of its own in the arena (its records are): the work rows
                    source = work
                cached.append(CachedTensor(entry, source.view(experts, row), pool, work.view(experts, row)))
                _set_tensor(entry, entry.view_of(work))
                if layer not in coded:  # coded bytes are no view of the weights: restore() decodes them
                    installed = entry.tensor
                    self._host_views.append((entry, installed, installed.data_ptr(), entry.view_of(host)))
            if layer in coded:
                host_region, records = coded[layer]
                self.caches.append(coded_experts.CodedCopy(module, cached, experts, host_region,
                                                           self._flat[signature], records, self.landing))
            elif self.copies:
                self.caches.append(ExpertCopy(module, cached, experts))
            else:
                table = CacheTable(experts, slots, device, fill_calls)
                self.caches.append(ExpertCache(module, cached, table))
        # each expert weight's version as installed (`gather` refuses a write since; id -> version)
        self.versions = {id(t.entry.tensor): t.entry.tensor._version for c in self.caches for t in c.tensors}
        self.eager_calls = 0  # forwards run eagerly on a GPU (counted at the first cached layer)
        # off once a capture is seen or the warning is given; copies run eagerly by design
        self.watch_eager = device.type == "cuda" and not self.copies
        self.arena: torch.Tensor | None = None  # the host arena and the model's guards (`watch_host`)
        self.guards = None
        self.arena_version = 0
        self.cache_id = next(_IDS)
        _CACHES[self.cache_id] = self
        # held from a layer's gather to the end of its experts' forward (eagerly): threads calling the
        # model at once would otherwise overwrite the work buffers another thread's experts are reading
        self.lock = threading.Lock()
        for i, c in enumerate(self.caches):  # each experts module gathers before it computes
            c.module._ws_cache_id, c.module._ws_cache_layer = self.cache_id, i
            c.module.__class__ = _gathered_class(type(c.module))

    @property
    def pool_bytes(self) -> int:
        """Device bytes of every slot pool."""
        return sum(c.pool_bytes for c in self.caches)

    @property
    def work_bytes(self) -> int:
        """Device bytes of the shared work buffers."""
        return sum(flat.numel() for flat in self._flat.values())

    @property
    def landing_bytes(self) -> int:
        """Device bytes of coded copies' landing buffers (0 without)."""
        return self.landing.nbytes if self.landing is not None else 0

    @property
    def nbytes(self) -> int:
        """Device bytes of the caches: pools plus work buffers plus landing buffers."""
        return self.pool_bytes + self.work_bytes + self.landing_bytes

    def wire_ratio(self) -> float | None:
        """Coded copies: bytes held (and copied per expert) over their raw bytes; None without."""
        coded = [c for c in self.caches if isinstance(c, coded_experts.CodedCopy)]
        raw = sum(c.row_bytes * c.experts for c in coded)
        return sum(c.wire_bytes for c in coded) / raw if raw else None

    def before_experts(self, i: int, tensors: list[torch.Tensor]) -> None:
        """Run eagerly before layer `i`'s experts compute on `tensors` (hidden states, routing, the rest):
        refuse autograd, count the forward on a GPU, gather."""
        ops._refuse_autograd(tensors)
        if i == 0 and self.watch_eager:
            self.note_eager_call(torch.cuda.is_current_stream_capturing())
        self.gather(i, tensors[1])

    def watch_host(self, arena: torch.Tensor, guards) -> None:
        """Watch the host `arena` (its bytes) and the tensors `guards` (`ModelGuards`) handed out, from
        the first layer's gather of every forward (`_outside_writes`)."""
        self.arena, self.guards, self.arena_version = arena, guards, arena._version

    def _outside_writes(self) -> None:
        """Writes since the last forward through what parameters() or state_dict() gave: to the host
        arena itself (raw experts' true bytes), which the caches' slots copied before, so every slot is
        emptied and filled again from host memory; or to a copy (experts held coded), which the weights
        never see: refused, once. Checked here as well as at streamed blocks' waits, since a model whose
        blocks are all resident or read in place has none."""
        if self.arena is not None and self.arena._version != self.arena_version:
            self.arena_version = self.arena._version
            for c in self.caches:
                if isinstance(c, ExpertCache):
                    c.table.table.fill_(-1)
                    c.table.owner.fill_(-1)
        lost = self.guards.lost_writes() if self.guards is not None else []
        if lost:
            raise OffloadStateError(
                f"{lost[0]} was written in place through the tensor parameters() or state_dict() gave for "
                "it while offloaded; it is held compressed (or read from disk), so that tensor was a copy "
                "and the write never reached the weights (they are as they were). To edit weights, do it "
                "inside `with handle.edit():` or before offload()")

    def gather(self, i: int, top_k_index: torch.Tensor) -> None:
        """Layer `i`'s gather, after checking that no expert weight of the layer was written in place
        since the last one: it views a work buffer that the gather overwrites, so the write never
        reached the weights; refused, once. (A weight's version counter is its own: gathers, which write
        the buffers through other tensors, do not move it.) The first layer's checks writes to the host
        first (`_outside_writes`)."""
        if i == 0:
            self._outside_writes()
        cache = self.caches[i]
        for t in cache.tensors:
            tensor = t.entry.tensor
            if self.versions.get(id(tensor), tensor._version) != tensor._version:
                self.versions[id(tensor)] = tensor._version
                raise OffloadStateError(
                    f"{t.entry.name} was written in place outside its block's forward while offloaded: "
                    "routed experts behind a GPU expert cache or expert copies are views of work buffers "
                    "that the next gather overwrites, so the write never reached the weights (they are as "
                    "they were). Edit weights inside `with handle.edit():` or before offload()")
        cache.gather(top_k_index)

    def note_eager_call(self, capturing: bool) -> None:
        """Count a forward that runs the caches' Python path on a GPU; `capturing`: inside a CUDA graph
        capture (replays then skip Python: no warning ever). Warns once at `EAGER_WARN_CALLS` eager
        forwards, which cost more than the cache saves."""
        if capturing:
            self.watch_eager = False
            return
        self.eager_calls += 1
        if self.eager_calls >= EAGER_WARN_CALLS:
            self.watch_eager = False
            warnings.warn(
                f"weightstream: the GPU expert cache of {len(self.caches)} layers ran {self.eager_calls} "
                "forwards eagerly: its table update and copies are dozens of small launches per layer, "
                "which make eager decode slower than without the cache (1.84x on an H100, Qwen3-30B-A3B). "
                "Decode from a CUDA graph (torch.compile(model, mode=\"reduce-overhead\") or "
                "torch.cuda.graph), where it pays, or offload with expert_cache=False to run eagerly "
                "(`weightstream generate`: --compile graphs, or leave out --routing-skew).",
                stacklevel=2)

    def counts(self) -> dict[str, float]:
        """What the caches counted since they went on or were last `reset` (one synchronization): calls,
        tokens (of one forward counted once: the most any layer saw), experts reached, hits, and bytes
        read from host memory. Expert copies count nothing themselves (all zero): the routers' counters
        (`handle.count_experts`) count the experts they copy, as for experts read in place."""
        if self.copies:
            return dict.fromkeys(("calls", "tokens", "reached", "hits", "host_bytes"), 0)
        rows = [c.table.counts.tolist() for c in self.caches]
        return {"calls": sum(r[0] for r in rows), "tokens": max((r[1] for r in rows), default=0),
                "reached": sum(r[2] for r in rows), "hits": sum(r[3] for r in rows),
                "host_bytes": sum(r[4] * c.row_bytes for r, c in zip(rows, self.caches, strict=True))}

    def hit_rate(self) -> float | None:
        """Hits over experts reached since the last reset; None before any."""
        counts = self.counts()
        return counts["hits"] / counts["reached"] if counts["reached"] else None

    def reset_counts(self) -> None:
        """Start counting from zero (the tables and pools stay as they are)."""
        for c in self.caches:
            if not self.copies:
                c.table.counts.zero_()

    def remove(self) -> None:
        """Give each experts module its own class back and point each parameter back at its host bytes;
        forget this cache."""
        for c in self.caches:
            module = c.module
            if type(module) in _GATHERED_CLASSES.values():
                module.__class__ = type(module).__mro__[1]
                del module._ws_cache_id, module._ws_cache_layer
        for entry, tensor, address, host_view in self._host_views:
            # still the tensor installed, on its work buffer (the model bound no other, nor gave it other
            # memory through `.data =`, since: those are the model's weights now)
            if entry.tensor is tensor and tensor.data_ptr() == address:
                _set_tensor(entry, host_view)
        _CACHES.pop(self.cache_id, None)


_GATHERED_CLASSES: dict[type, type] = {}


def _gathered_class(base: type) -> type:
    """A subclass of the experts class `base` whose forward runs its layer's gather first (eagerly, or
    through the op `expert_gather` where traced: every read of the parameters follows it).

    A class rather than a forward pre-hook: torch.compile guards on a submodule's type but not on its
    hooks (torch._dynamo.config.skip_nnmodule_hook_guards), so a graph compiled for another model of the
    same class (the resident twin, a model compiled before offload) ran for this one without the gather,
    its experts reading the work buffers as the last gather left them. The routing weights do not go
    through the op: the compiler fuses their softmax and normalization into the experts' weighting as it
    does resident, where a stored copy rounded them otherwise."""
    if base not in _GATHERED_CLASSES:
        original = base.forward

        def forward(self, hidden, top_k_index, *rest, **kwargs):
            tensors = [hidden, top_k_index, *(t for t in rest if isinstance(t, torch.Tensor))]
            if _traced(tensors):
                hidden, top_k_index = torch.ops.weightstream.expert_gather(
                    [hidden, top_k_index], self._ws_cache_id, self._ws_cache_layer)
                return original(self, hidden, top_k_index, *rest, **kwargs)
            caches = _caches(self._ws_cache_id)
            with caches.lock:  # one thread's experts at a time: every layer's gather writes the work buffers
                caches.before_experts(self._ws_cache_layer, tensors)
                return original(self, hidden, top_k_index, *rest, **kwargs)

        _GATHERED_CLASSES[base] = type(f"Gathered{base.__name__}", (base,), {"forward": forward})
    return _GATHERED_CLASSES[base]


def copyable(group: list[tuple]) -> str | None:
    """None where a zero-copy group's routed tensors can go through a cache or copies (all plain
    parameters of one experts module called as experts(hidden, top_k_index, top_k_weights), one row per
    expert, in rows), else the name of the first tensor that cannot."""
    for entry, _ in group:
        module = entry.sites[0].module
        if not (is_experts(module) and isinstance(entry.tensor, nn.Parameter) and entry.flat is None
                and entry.stride is None  # rows of experts: the layout in rows
                and len(entry.sites) == 1 and entry.shape[0] == module.num_experts):
            return entry.name
    return None


def coded_groups(prep) -> list[int]:
    """The zero-copy groups (indices into `prep.uva_groups`) whose routed experts are held coded: those
    of `expert_copies` blocks when the placement codes copies, each the tensors of one experts module
    that copies can take (`copyable`)."""
    p = prep.placement
    if not (p.expert_copies and p.copy_landing_bytes):
        return []
    return [j for j, (block, group) in enumerate(zip(p.uva, prep.uva_groups, strict=True))
            if block in p.expert_copies and copyable(group) is None
            and len({id(e.sites[0].module) for e, _ in group}) == 1]


def install(prep, regions: list[torch.Tensor], host_regions: list[torch.Tensor],
            coded: dict[int, list] | None = None) -> ExpertCaches | None:
    """The expert caches, or expert copies, of `prep.placement` (None without either), over the
    zero-copy groups' arena regions: `regions` as the device reads them (zero-copy views on CUDA),
    `host_regions` the same bytes as the host addresses them (what the copy engine copies from). Each
    such block's routed tensors are grouped by the experts module that holds them; a block whose routed
    tensors are not all plain parameters of such a module (`copyable`) keeps reading them in place, and a
    warning names it. `coded`: zero-copy group -> its `coded_experts.Record`s (groups of `coded_groups`,
    whose regions hold them)."""
    p = prep.placement
    coded = coded or {}
    chosen = p.expert_copies or p.expert_cache
    layers: list[tuple[nn.Module, list]] = []
    layer_coded: dict[int, tuple] = {}
    blocks, refused = [], []
    for j, (block, group, region, host) in enumerate(zip(p.uva, prep.uva_groups, regions, host_regions,
                                                          strict=True)):
        if block not in chosen:
            continue
        name = None if j in coded else copyable(group)  # coded ones were checked before they were emptied
        if name is not None:
            refused.append(f"{block} ({name})")
            continue
        modules: dict[int, tuple[nn.Module, list]] = {}
        for entry, sl in group:
            modules.setdefault(id(entry.sites[0].module), (entry.sites[0].module, []))[1].append(
                (entry, region[sl.offset : sl.offset + sl.nbytes], host[sl.offset : sl.offset + sl.nbytes]))
        if j in coded:
            layer_coded[len(layers)] = (host, coded[j])
        layers.extend(modules.values())
        blocks.append(block)
    if refused:
        what = "expert copies" if p.expert_copies else "a GPU expert cache"
        warnings.warn(f"weightstream: blocks {', '.join(refused)} were placed for {what} but hold routed "
                      "tensors that are not plain parameters of an experts module called as experts(hidden, "
                      "top_k_index, top_k_weights) with one row per expert: they read their experts in place",
                      stacklevel=3)
    if not layers:
        return None
    caches = ExpertCaches(layers, 0 if p.expert_copies else p.expert_slots, prep.device, coded=layer_coded,
                          landing_bytes=p.copy_landing_bytes)
    caches.blocks = tuple(blocks)
    return caches


def _traced(tensors: list[torch.Tensor]) -> bool:
    """Whether this call is traced (torch.compile, export, fake tensors): then the gather goes through
    the custom op, which the compiler cannot move."""
    return (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or any(type(t) is not torch.Tensor for t in tensors))


def _caches(cache_id: int) -> ExpertCaches:
    try:
        return _CACHES[cache_id]
    except KeyError:
        raise OffloadStateError(
            f"weightstream expert cache {cache_id} is gone (handle.restore() was called, or the offloaded "
            "model was deleted): this compiled or captured forward still refers to it; compile or capture "
            "the model again") from None


@torch.library.custom_op("weightstream::expert_gather", mutates_args=())
def expert_gather(tensors: list[torch.Tensor], cache_id: int, layer: int) -> list[torch.Tensor]:
    """Before cached layer `layer`'s experts compute: update its table for the routing in tensors[1]
    and fill the work buffers; returns a copy of each tensor (the experts' hidden states and routing)."""
    _caches(cache_id).gather(layer, tensors[1])
    return [t.clone() for t in tensors]


@expert_gather.register_fake
def _expert_gather_fake(tensors: list[torch.Tensor], cache_id: int, layer: int) -> list[torch.Tensor]:
    return [torch.empty_like(t) for t in tensors]


expert_gather.register_autograd(ops._unreachable_backward, setup_context=ops._no_autograd)
