"""The planner: from a GPU memory budget to the fastest placement the cost model knows. Pure logic.

Each block is resident, streamed through staging slots, or read in place from pinned host memory
(zero copy, "uva"). Candidates: k blocks streamed, spread evenly through the model so copies hide
behind the resident blocks between them, with two slots (one computes while the next copies) or one;
the same with only each streamed block's p largest tensors streaming (parameter granularity: its MLP,
say, while its attention stays resident, which needs smaller slots and fills the budget more closely);
k blocks zero copy (no staging memory, so more stays resident); and mixes of whole streamed and
zero-copy blocks. In a mixture of experts a zero-copy block may read only its routed expert tensors in
place and keep the rest (attention, norms, router, shared experts, which every token reads in full)
resident: e of the k zero-copy blocks do so, for every e. The planner
keeps the candidates that fit the budget, staging included, and returns the one the cost model
predicts fastest for the given tokens per forward. A larger budget only adds candidates, so it never
predicts slower.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from ..errors import ArgumentError, BudgetError
from ..sizes import format_size
from ..wire import codec
from .cost import ModelCost, Prediction, predict
from .experts import zipf_popularity
from .layout import align_up
from .probe import MachineProfile

STRATEGIES = ("auto", "stream", "uva")


@dataclass(frozen=True)
class Placement:
    """A placement of a model's weights. Sizes in bytes.

    `streamed` lists the streamed blocks in forward order; each is one group, and group i (its
    position in `streamed`) is staged in slot i % n_slots. With `part` > 0 only each streamed block's
    `part` largest tensors stream and the rest of it stays resident. `uva` lists the zero-copy blocks;
    those also in `uva_experts` read only their routed expert tensors in place, the rest of each stays
    resident.
    `offloaded_bytes` are the bytes kept off the GPU: those that stream through the slots plus the
    zero-copy ones (`uva_bytes`). `requested_strategy` is what was asked for ("auto", "stream",
    "uva"); `kind` is what the placement turned out to be.
    """

    streamed: tuple[int, ...]
    n_slots: int
    slot_bytes: int
    resident_bytes: int
    offloaded_bytes: int
    uva: tuple[int, ...] = ()
    uva_bytes: int = 0
    prediction: Prediction | None = None
    part: int = 0  # each streamed block streams its `part` largest tensors (cost.largest); 0: all of it
    requested_strategy: str = "auto"
    landing_bytes: int = 0  # compressed groups: the size of each GPU landing buffer; 0: groups stream raw
    landing_buffers: int = 0  # how many (0: raw; see n_landing)
    uva_experts: tuple[int, ...] = ()  # zero-copy blocks read in place for their routed experts only
    # blocks of uva_experts whose routed experts go through a GPU expert cache (engine/expert_cache.py)
    # of `expert_slots` slots each; `cache_bytes`: its pools plus the work buffers they share
    expert_cache: tuple[int, ...] = ()
    expert_slots: int = 0
    cache_bytes: int = 0
    # blocks of uva_experts whose routed experts the copy engine copies into work buffers every call,
    # once the host has read the routing (engine/expert_cache.ExpertCopy; their work buffers count in
    # cache_bytes); eager and compiled only: a CUDA graph cannot capture the host's read
    expert_copies: tuple[int, ...] = ()
    # coded expert copies: the routed experts of `expert_copies` are held in host memory compressed, one
    # blob per expert (codec.py), copied into one of two landing buffers of this many bytes and decoded
    # into the work buffers (engine/coded_experts.py); 0: copied raw
    copy_landing_bytes: int = 0

    @property
    def compressed(self) -> bool:
        """True when streamed groups cross the link compressed (codec.py) and are decoded on the GPU."""
        return self.landing_bytes > 0

    @property
    def n_landing(self) -> int:
        """Landing buffers of compressed groups (0 when they stream raw): group i lands in buffer
        i % n_landing. One per slot; with one slot, one (the least memory) or two (the next group's
        bytes land while the current one decodes into the slot and computes)."""
        return self.landing_buffers if self.compressed else 0

    @property
    def staging_bytes(self) -> int:
        """GPU bytes taken by the staging slots and, for compressed groups, their landing buffers."""
        return self.n_slots * self.slot_bytes + self.n_landing * self.landing_bytes

    @property
    def gpu_bytes(self) -> int:
        """GPU bytes of weights: resident tensors plus staging slots plus the expert cache (or the expert
        copies' work buffers, and their two landing buffers when coded)."""
        return self.resident_bytes + self.staging_bytes + self.cache_bytes + 2 * self.copy_landing_bytes

    @property
    def streamed_bytes(self) -> int:
        """Bytes that stream through the staging slots (the offloaded bytes less the zero-copy ones)."""
        return self.offloaded_bytes - self.uva_bytes

    @property
    def kind(self) -> str:
        """"resident", "stream", "uva" or "mix": what the placement does with the blocks off the GPU."""
        return {(False, False): "resident", (True, False): "stream", (False, True): "uva"}.get(
            (bool(self.streamed), bool(self.uva)), "mix")


def predict_placement(model: ModelCost, p: Placement, tokens: int, profile: MachineProfile) -> Prediction:
    """The cost model's prediction of placement `p` of `model` at `tokens` tokens per forward."""
    return predict(model, p.streamed, p.n_slots, p.uva, tokens, profile, p.part, p.compressed, p.n_landing,
                   p.uva_experts, p.expert_cache, p.expert_slots, p.expert_copies, bool(p.copy_landing_bytes))


def wire_of(model: ModelCost, p: Placement) -> tuple[int, int]:
    """(predicted bytes on the wire, raw bytes) of what placement `p` streams per forward: compressed
    groups' blobs, or the raw groups (then the two are equal)."""
    raw = sum(model.streamed_bytes(i, p.part) for i in p.streamed)
    return (sum(model.wire_bytes(i, p.part) for i in p.streamed) if p.compressed else raw), raw


def landing_options(n_slots: int, n_groups: int) -> tuple[int, ...]:
    """How many landing buffers `n_groups` compressed groups through `n_slots` slots may have, the
    default first: one per slot, or with one slot and two groups or more, two (group i+1 lands while
    group i decodes and computes) or one."""
    return (2, 1) if n_slots == 1 and n_groups > 1 else (n_slots,)


def host_need(model: ModelCost, streamed: tuple[int, ...], uva: tuple[int, ...], part: int = 0,
              uva_experts: tuple[int, ...] = ()) -> int:
    """Host bytes a placement needs at the least: its zero-copy blocks (read in place, so in host
    memory; of `uva_experts` blocks their routed experts), plus every streamed group or, when some of
    them stay on disk, two bounce buffers of the largest streamed group."""
    groups = [model.staging(i, part) for i in streamed]
    in_place = sum(model.uva_staging(i, i in uva_experts) for i in uva)
    return in_place + min(sum(groups), 2 * max(groups, default=0))


def _landing(model: ModelCost, streamed: tuple[int, ...], part: int) -> int:
    """Bytes of a landing buffer for the compressed groups of `streamed`: the largest predicted wire
    size plus 1%, so a group whose real size exceeds the prediction is rare (it streams raw)."""
    largest_wire = max(model.wire_bytes(i, part) for i in streamed)
    return align_up(int(largest_wire * 1.01) + 1)


def spread(n: int, k: int) -> tuple[int, ...]:
    """Return k of the indices 0..n-1, evenly spread (k=n gives all of them)."""
    return tuple(sorted({(2 * i + 1) * n // (2 * k) for i in range(k)}))


def choose_disk_groups(group_bytes: list[int], cpu_memory: int | None) -> frozenset[int]:
    """The indices of the streamed groups (sizes in bytes) that stay on disk when host memory for them
    is limited to `cpu_memory` bytes (None: no limit), two pinned bounce buffers of the largest group
    counted: `from_pretrained`'s disk tier. Disk groups are spread through the model, so the disk
    reader works ahead while host groups stream. Pure logic. Raises BudgetError when `cpu_memory`
    cannot hold the two bounce buffers."""
    if cpu_memory is None or sum(group_bytes) <= cpu_memory:
        return frozenset()
    bounce = max(group_bytes)
    room = cpu_memory - 2 * bounce
    if room < 0:
        raise BudgetError(
            f"cpu_memory={format_size(cpu_memory)} cannot hold the disk tier's two bounce buffers: give at "
            f"least {format_size(2 * bounce)} ({2 * bounce} bytes), or no cpu_memory limit",
            2 * bounce,
        )
    n = len(group_bytes)
    for k in range(1, n + 1):
        on_disk = spread(n, k)
        if sum(b for g, b in enumerate(group_bytes) if g not in on_disk) <= room:
            return frozenset(on_disk)
    raise AssertionError("unreachable: all groups on disk always fit")


def _candidates(n: int, strategy: str, max_slots: int, max_part: int):
    """(streamed, uva, n_slots, part) of block indices for `strategy`; part 0 streams whole blocks,
    part p in 1..max_part - 1 each streamed block's p largest tensors."""
    yield (), (), 0, 0  # everything resident
    for k in range(1, n + 1):
        off = spread(n, k)
        if strategy in ("auto", "uva"):
            yield (), off, 0, 0
        if strategy == "uva":
            continue
        splits = range(k) if strategy == "auto" else [0]  # u of the k off-GPU blocks read in place
        for u in splits:
            in_place = tuple(off[i] for i in spread(k, u)) if u else ()
            streamed = tuple(b for b in off if b not in in_place)
            for n_slots in range(min(max_slots, len(streamed)), 0, -1):
                yield streamed, in_place, n_slots, 0
        for part in range(1, max_part):
            for n_slots in range(min(max_slots, k), 0, -1):
                yield off, (), n_slots, part


def _expert_candidates(n: int, strategy: str, max_slots: int, apart: tuple[int, ...]):
    """(streamed, uva, n_slots, part, uva_experts): the zero-copy candidates of `_candidates` whose
    blocks of `apart` (those whose routed experts can be read in place without the rest of them) read
    only their experts in place: of k zero-copy blocks, e of those for every e; in mixes with streamed
    blocks all of them."""
    if not apart or strategy == "stream":
        return
    for k in range(1, n + 1):
        off = spread(n, k)
        able = tuple(b for b in off if b in apart)
        for e in range(1, len(able) + 1):
            yield (), off, 0, 0, tuple(able[i] for i in spread(len(able), e))
        if strategy == "uva":
            continue
        for u in range(1, k):
            in_place = tuple(off[i] for i in spread(k, u))
            streamed = tuple(b for b in off if b not in in_place)
            experts = tuple(b for b in in_place if b in apart)
            for n_slots in range(min(max_slots, len(streamed)), 0, -1) if experts else ():
                yield streamed, in_place, n_slots, 0, experts


def _with_copies(model: ModelCost, p: Placement, budget: int, tokens: int, profile: MachineProfile,
                 host_bytes: int | None, strategy: str, coded: bool = False) -> Placement | None:
    """Placement `p` with the routed experts of each of its blocks read for them copied by the copy
    engine instead (`Placement.expert_copies`), held compressed where `coded`; None where their work
    buffers (and landing buffers) do not fit the budget."""
    blocks = _plain_expert_blocks(model, p)
    if not blocks:
        return None
    return placement_of(model, p.streamed, p.n_slots, p.uva, p.part, tokens, profile, budget, host_bytes,
                        strategy, p.compressed, p.landing_buffers or None, uva_experts=p.uva_experts,
                        expert_copies=blocks, coded_copies=coded)


def _coded(p: Placement) -> bool:
    """Whether placement `p` moves bytes compressed: streamed groups, or copied experts."""
    return p.compressed or bool(p.copy_landing_bytes)


def _plain_expert_blocks(model: ModelCost, p: Placement) -> tuple[int, ...]:
    """The blocks `p` reads for their routed experts whose experts are not quantized: those a work buffer
    (a GPU expert cache, expert copies) can take."""
    return tuple(b for b in p.uva_experts if not (model.quant_bytes and model.quant_bytes[b]))


def _with_cache(model: ModelCost, p: Placement, budget: int, tokens: int, profile: MachineProfile,
                host_bytes: int | None, strategy: str) -> Placement | None:
    """Placement `p` with a GPU expert cache on each of its blocks read for their plain routed experts,
    as many slots each (below every expert) as the budget `p` leaves holds beside the shared work
    buffers; None where not one slot fits."""
    blocks = _plain_expert_blocks(model, p)
    if not blocks:
        return None
    per_slot = model.cache_bytes(blocks, 1) - model.cache_bytes(blocks, 0)
    slots = min(model.experts - 1, (budget - p.gpu_bytes - model.cache_bytes(blocks, 0)) // per_slot)
    if slots < 1:
        return None
    return placement_of(model, p.streamed, p.n_slots, p.uva, p.part, tokens, profile, budget, host_bytes,
                        strategy, uva_experts=p.uva_experts, expert_cache=blocks, expert_slots=slots)


def placement_of(
    model: ModelCost,
    streamed: tuple[int, ...],
    n_slots: int,
    uva: tuple[int, ...] = (),
    part: int = 0,
    tokens: int = 1,
    profile: MachineProfile | None = None,
    budget: int | None = None,
    host_bytes: int | None = None,
    strategy: str = "auto",
    compressed: bool = False,
    landing_buffers: int | None = None,
    uva_experts: tuple[int, ...] = (),
    expert_cache: tuple[int, ...] = (),
    expert_slots: int = 0,
    expert_copies: tuple[int, ...] = (),
    coded_copies: bool = False,
) -> Placement | None:
    """The placement that streams blocks `streamed` through `n_slots` slots (each block's `part`
    largest tensors; 0: all of it) and reads blocks `uva` in place, with its predicted time; None when
    it does not fit `budget` bytes of GPU memory or `host_bytes` of host memory (no limit when None).
    `strategy` is recorded as the requested one. `compressed`: groups cross the link compressed (None
    where they would not shrink), through `landing_buffers` landing buffers (one of `landing_options`;
    None: the first). `uva_experts`: zero-copy blocks that read only their routed expert tensors in
    place (`ModelCost.experts_apart`), the rest of each resident. `expert_cache`: blocks of
    `uva_experts` whose routed experts go through a GPU cache of `expert_slots` slots each
    (`ModelCost.cache_bytes`); `expert_copies`: blocks of `uva_experts` (none of them cached) whose
    routed experts the copy engine copies into work buffers every call; `coded_copies`: held compressed
    in host memory and decoded on the GPU (two landing buffers of `ModelCost.expert_landing_bytes`;
    None where the experts would not shrink). Tests and tools use it to force a placement."""
    if profile is None:
        from .probe import H200 as profile
    sizes = model.block_bytes
    if bool(streamed) != (n_slots > 0) or set(streamed) & set(uva):
        raise ArgumentError(f"streamed={streamed}, uva={uva}, n_slots={n_slots}: streamed blocks need at "
                            "least one slot, and a block is streamed or read in place, not both")
    if not set(uva_experts) <= set(uva) or not all(model.experts_apart(i) for i in uva_experts):
        raise ArgumentError(f"uva_experts={uva_experts}: name zero-copy blocks (of uva={uva}) that hold "
                            "routed expert tensors beside other tensors")
    if not set(expert_cache) <= set(uva_experts) or bool(expert_cache) != (expert_slots > 0) or \
            (expert_cache and expert_slots > model.experts):
        raise ArgumentError(f"expert_cache={expert_cache}, expert_slots={expert_slots}: name blocks of "
                            f"uva_experts={uva_experts} and 1..{model.experts} slots for each, or neither")
    if not set(expert_copies) <= set(uva_experts) or (expert_copies and expert_cache):
        raise ArgumentError(f"expert_copies={expert_copies}: name blocks of uva_experts={uva_experts}, with "
                            f"no expert_cache (given {expert_cache}): a placement caches experts or copies "
                            "them, not both")
    if coded_copies and not expert_copies:
        raise ArgumentError("coded_copies=True: name the blocks whose experts are copied (expert_copies)")
    options = landing_options(n_slots, len(streamed))
    if landing_buffers is None:
        landing_buffers = options[0]
    if compressed and landing_buffers not in options:
        raise ArgumentError(f"landing_buffers={landing_buffers}: with {n_slots} slot(s) and {len(streamed)} "
                            f"streamed group(s) choose one of {', '.join(map(str, options))}")
    off = set(streamed) | set(uva)
    resident = model.fixed_bytes + sum(b for i, b in enumerate(sizes) if i not in off)
    resident += sum(sizes[i] - model.streamed_bytes(i, part) for i in streamed)
    resident += sum(sizes[i] - model.uva_bytes(i, True) for i in uva_experts)
    slot = max((model.staging(i, part) for i in streamed), default=0)
    landing = _landing(model, streamed, part) if compressed and streamed else 0
    if landing > 0.95 * slot:
        return None  # groups that would not shrink (they would stream raw)
    n_landing = landing_buffers if landing else 0
    staging = n_slots * slot + n_landing * landing
    cache = model.cache_bytes(expert_cache, expert_slots) + model.cache_bytes(expert_copies, 0)
    copy_landing = model.expert_landing_bytes(expert_copies) if coded_copies else 0
    if coded_copies and max(model.routed_wire_ratio(i) for i in expert_copies) > codec.MAX_RATIO:
        return None  # experts that would not shrink (they would be copied raw)
    if budget is not None and resident + staging + cache + 2 * copy_landing > budget:
        return None
    if host_bytes is not None and host_need(model, streamed, uva, part, uva_experts) > host_bytes:
        return None
    prediction = predict(model, streamed, n_slots, uva, tokens, profile, part, bool(landing), n_landing,
                         uva_experts, expert_cache, expert_slots, expert_copies, bool(copy_landing))
    total = model.fixed_bytes + sum(sizes)
    return Placement(tuple(streamed), n_slots, slot, resident, total - resident, tuple(uva),
                     sum(model.uva_bytes(i, i in uva_experts) for i in uva), prediction, part,
                     requested_strategy=strategy, landing_bytes=landing, landing_buffers=n_landing,
                     uva_experts=tuple(uva_experts), expert_cache=tuple(expert_cache),
                     expert_slots=expert_slots, cache_bytes=cache, expert_copies=tuple(expert_copies),
                     copy_landing_bytes=copy_landing)


def check_routing_skew(skew) -> None:
    """ArgumentError unless `skew` is a finite number >= 0 (a Zipf exponent of expert popularity)."""
    if isinstance(skew, bool) or not isinstance(skew, int | float) or not math.isfinite(skew) or skew < 0:
        raise ArgumentError(f"routing_skew={skew!r}: give the Zipf exponent of expert popularity, a number "
                            ">= 0 (0: uniform routing), or None to plan for uniform routing")


def with_routing_skew(model: ModelCost, routing_skew: float | None) -> ModelCost:
    """`model` with the expert popularity of Zipf(`routing_skew`) routing (`experts.zipf_popularity`),
    what a GPU expert cache's slots serve; `model` itself for None or a model without experts.
    ArgumentError for a skew that is not a Zipf exponent."""
    if routing_skew is None:
        return model
    check_routing_skew(routing_skew)
    if not model.experts:
        return model
    return dataclasses.replace(model, popularity=zipf_popularity(model.experts, model.top_k,
                                                                 float(routing_skew)))


def plan(
    model: ModelCost,
    budget: int,
    tokens: int = 1,
    profile: MachineProfile | None = None,
    strategy: str = "auto",
    max_slots: int = 2,
    host_bytes: int | None = None,
    compress: bool | str = "auto",
    experts_apart: bool = True,
    expert_cache: bool = True,
    routing_skew: float | None = None,
    expert_copies: bool = False,
    coded_copies: bool = True,
) -> Placement:
    """The fastest placement of `model` whose weights fit in `budget` bytes of GPU memory.

    tokens: tokens per forward to optimize for (1 for batch-1 decode, 2048 for such a prefill).
    strategy: "stream" (resident or streamed blocks), "uva" (resident or zero-copy blocks) or "auto"
        (either, or a mix, whichever the cost model predicts fastest).
    host_bytes: host memory for the offloaded weights (None: no limit). A placement is kept only when
        host memory holds its zero-copy blocks plus either every streamed group or, with the rest left
        on disk (`from_pretrained`'s disk tier), two bounce buffers of the largest streamed group.

    compress: True streams groups compressed (landing buffers count as staging) wherever a compressed
        placement fits, False raw, "auto" whichever predicts faster; needs `model.tensor_wire`
        (without it groups stream raw).
    experts_apart: let zero-copy blocks of a mixture of experts read only their routed experts in
        place, the rest of them resident (False: zero-copy blocks are read in place whole).
    expert_cache: let such blocks put a GPU expert cache in the budget they leave (`_with_cache`); the
        cost model keeps it only where it predicts faster.
    routing_skew: the expert popularity to plan a cache for: each token draws its experts from a
        Zipf(routing_skew) law (`experts.zipf_popularity`; 0: uniform), so k slots serve the k most
        popular experts' share of the reads; None: uniform routing.
    expert_copies: blocks read for their routed experts copy them by the copy engine each call instead
        (`_with_copies`; no cache): one host synchronization per such layer, no CUDA graphs. Asked for,
        copies are taken wherever their work buffers fit (as compress=True takes compression; a placement
        keeping every block resident is compared by speed alone), even where reading in place is
        predicted faster: the cost model reads every in-place GEMM at one
        rate, which some expert shapes fall far below (docs/llm.md). With compress=True and
        `coded_copies`, the copied experts are held compressed wherever they fit (one blob per expert,
        decoded on the GPU); compress="auto" copies them raw.
    """
    model = with_routing_skew(model, routing_skew)
    if strategy not in STRATEGIES:
        raise ArgumentError(f"strategy={strategy!r}: choose one of {', '.join(STRATEGIES)}")
    if compress not in (True, False, "auto"):
        raise ArgumentError(f"compress={compress!r}: choose True, False or 'auto'")
    # compress=True still falls back to raw groups where no compressed placement fits the budget
    options = (False, True) if model.tensor_wire and compress is not False else (False,)
    # coded copies only where compression is asked for (compress=True): "auto" copies raw until coded
    # copies have been measured against raw ones on a GPU (CHANGELOG)
    code_copies = bool(model.tensor_wire) and compress is True and coded_copies

    def better(a: Placement, b: Placement | None) -> bool:
        if b is None:
            return True
        # asked for, copies and compression are taken where they fit, among placements that move bytes
        # over the link: one that keeps every block resident moves none, and is compared by speed
        both_move = a.kind != "resident" and b.kind != "resident"
        if expert_copies and both_move and bool(a.expert_copies) != bool(b.expert_copies):
            return bool(a.expert_copies)
        if compress is True and both_move and _coded(a) != _coded(b):
            return _coded(a)
        # a forward in a loop of them (to a nanosecond: float sums in another order differ by less);
        # ties (streamed groups alone in their slots, which never leave them) go to the first forward
        return (round(a.prediction.again_ms, 6), a.prediction.ms) < (round(b.prediction.again_ms, 6),
                                                                     b.prediction.ms)

    if profile is None:
        from .probe import H200 as profile
    n = len(model.block_bytes)
    best: Placement | None = None
    max_part = max((len(t) for t in model.tensor_bytes), default=0)
    apart = tuple(i for i in range(n) if model.experts_apart(i)) if experts_apart else ()
    candidates = itertools.chain(((*c, ()) for c in _candidates(n, strategy, max_slots, max_part)),
                                 _expert_candidates(n, strategy, max_slots, apart))
    for streamed, uva, n_slots, part, uva_experts in candidates:
        for compressed in options if streamed else (False,):
            for buffers in landing_options(n_slots, len(streamed)) if compressed else (None,):
                candidate = placement_of(model, streamed, n_slots, uva, part, tokens, profile, budget,
                                         host_bytes, strategy, compressed, buffers, uva_experts)
                if candidate is not None and uva_experts and expert_copies:  # where the work buffers fit
                    for coded in (False, True) if code_copies else (False,):
                        copied = _with_copies(model, candidate, budget, tokens, profile, host_bytes, strategy,
                                              coded)
                        if copied is not None and better(copied, best):
                            best = copied
                if candidate is not None and better(candidate, best):
                    best = candidate
                if candidate is not None and expert_cache and uva_experts and not compressed and \
                        not expert_copies:
                    cached = _with_cache(model, candidate, budget, tokens, profile, host_bytes, strategy)
                    if cached is not None and better(cached, best):
                        best = cached
    if best is not None:
        return best
    if host_bytes is not None:
        # raises if the GPU is the limit
        gpu_only = plan(model, budget, tokens, profile, strategy, max_slots, experts_apart=experts_apart)
        need = host_need(model, gpu_only.streamed, gpu_only.uva, gpu_only.part, gpu_only.uva_experts)
        held = [what for what, there in (("the zero-copy blocks", gpu_only.uva), (
            "two bounce buffers of the largest streamed group (the disk tier)", gpu_only.streamed)) if there]
        raise BudgetError(
            f"cpu_memory={format_size(host_bytes)} cannot hold what the {format_size(budget)} GPU budget "
            f"leaves off the GPU: {' plus '.join(held)}, at least {format_size(need)} ({need} bytes). Give "
            "more cpu_memory or gpu_memory"
            + (", or strategy='stream' (which can leave groups on disk)" if strategy == "uva" else ""),
            need,
        )
    largest = max((model.staging(i) for i in range(n)), default=0)
    minimum = model.fixed_bytes + (0 if strategy != "stream" else largest)
    raise BudgetError(
        f"gpu_memory={format_size(budget)} cannot hold the weights that must stay on the GPU "
        f"({format_size(model.fixed_bytes)} outside the repeated blocks)"
        + (f" plus one staging slot ({format_size(largest)})" if strategy == "stream" else "")
        + f": give at least {format_size(minimum)} ({minimum} bytes)"
        + (f"; two slots, which overlap copies with compute, need {model.fixed_bytes + 2 * largest} bytes"
           if strategy == "stream" else ""),
        minimum,
    )
