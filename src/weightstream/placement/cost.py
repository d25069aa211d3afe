"""The cost model: predicted time of one forward for a placement. Pure logic, no CUDA.

Blocks run in order on the compute stream. A resident block costs its GEMM time at the given tokens per
forward plus what it spends outside its GEMMs (norms, attention, activations: measured per unit of
activation width, so it needs the model's width); a zero-copy (uva) block costs the same GEMMs reading
their weights over the link; a streamed block cannot start before its group's copy has landed, and each
copy waits for the copy stream and for its slot to be released (the schedule of `schedule.py`, simulated
with two clocks). Zero-copy reads and copies share the one link, so they never overlap each other. The
LM head runs last. Rates come from a `MachineProfile` (`probe.py`).

In a mixture-of-experts block a token's GEMMs read only the experts it is routed to: at few tokens per
forward the block's GEMMs read a share of its expert bytes (the share of experts any token is routed
to), each expert at the tokens routed to it. That holds wherever the weights are, so a zero-copy block
reads only those bytes over the link, while a copy must move every expert (the router has not run yet).
A zero-copy block may also read only its routed experts in place, its other tensors (attention, norms,
router, shared experts: read in full by every token) resident on the device; then only the routed share
crosses the link.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .layout import pack
from .probe import MachineProfile


@functools.lru_cache(maxsize=1 << 16)  # the planner asks for the same blocks' tensors many times
def largest(sizes: tuple[int, ...], part: int) -> tuple[int, ...]:
    """Positions of the `part` largest of `sizes` (ties: the earlier one), in position order; all of
    them when part is 0 or at least len(sizes). In a transformer block the largest tensors are the
    MLP's, so streaming a block's largest tensors keeps its attention resident."""
    if part <= 0 or part >= len(sizes):
        return tuple(range(len(sizes)))
    return tuple(sorted(sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))[:part]))


@dataclass(frozen=True)
class ModelCost:
    """What the cost model needs to know of a model, in bytes."""

    fixed_bytes: int  # everything outside the blocks (always resident)
    head_bytes: int  # the largest weight outside the blocks: the LM head GEMM dominates that part
    block_bytes: tuple[int, ...]  # each block's streamable bytes, in forward order
    slot_bytes: tuple[int, ...] = ()  # each block's staging footprint (aligned layout); default: its bytes
    width: int = 0  # activation width (hidden size) of a block; 0: count GEMM time only
    # each block's streamable tensors, in layout order; (): blocks can only be placed whole
    tensor_bytes: tuple[tuple[int, ...], ...] = ()
    routed_bytes: tuple[int, ...] = ()  # each block's bytes of routed experts (mixture of experts); (): none
    experts: int = 0  # routed experts per block
    top_k: int = 0  # experts each token is routed to
    # each block's stored bytes of quantized weights (fp8, int8, int4, tensor subclasses) and the bytes a
    # bf16 GEMM over the same weights would read; (): no quantized weights
    quant_bytes: tuple[int, ...] = ()
    quant_bf16_bytes: tuple[int, ...] = ()
    # each streamable tensor's predicted bytes on the wire when compressed (codec.choose), in the order
    # of tensor_bytes; (): compression not considered
    tensor_wire: tuple[tuple[int, ...], ...] = ()
    # each block's routed expert tensors: positions in tensor_bytes (fused 3-D tensors whose first
    # dimension is the expert); (): none, or tensors not known
    routed_tensors: tuple[tuple[int, ...], ...] = ()
    # the share of token-expert choices each routed expert takes, most popular first (sums to 1); ():
    # uniform routing. A GPU expert cache of k slots, filled by frequency, holds the k most popular.
    popularity: tuple[float, ...] = ()

    @property
    def _memo(self) -> dict:
        """What the methods below computed, by (method, arguments): the planner costs thousands of
        candidates over the same blocks. Kept beside the fields, not one of them: `dataclasses.replace`
        and unpickling start without it."""
        return self.__dict__.setdefault("_computed", {})

    def block_seconds(self, tokens: int, profile: MachineProfile) -> tuple[float, ...]:
        """Each block's seconds with its weights on the device (`resident_seconds` plus the profile's
        time outside the GEMMs for this width), at `tokens` tokens per forward."""
        key = ("block_seconds", tokens, id(profile))
        hit = self._memo.get(key)
        if hit is not None and hit[0] is profile:  # the same profile object (not a reused id)
            return hit[1]
        extra = profile.block_extra_seconds(self.width, tokens)
        seconds = tuple(self.resident_seconds(b, tokens, profile) + extra
                        for b in range(len(self.block_bytes)))
        self._memo[key] = (profile, seconds)
        return seconds

    def reads(self, block: int, tokens: int) -> tuple[tuple[float, float], ...]:
        """(bytes, tokens) of the GEMMs of `block` at `tokens` tokens per forward: its dense bytes at
        every token, and the expected bytes of the routed experts that any token reaches, each at the
        tokens routed to it (`reached_share`)."""
        routed = self.routed_bytes[block] if self.routed_bytes else 0
        dense = (self.block_bytes[block] - routed, tokens)
        if not routed:
            return (dense,)
        share = self.reached_share(tokens)
        return dense, (routed * share, tokens * self.top_k / (self.experts * share))

    def reached_share(self, tokens: int) -> float:
        """The expected share of a block's experts that `tokens` tokens reach, each choosing top_k: an
        expert chosen by a token with probability q is reached with 1 - (1 - q)^tokens; q = top_k /
        experts under uniform routing, top_k x its share of the choices under `popularity`."""
        key = ("reached_share", tokens)
        hit = self._memo.get(key)
        if hit is None:
            if self.popularity:
                hit = sum(1.0 - (1.0 - min(1.0, self.top_k * p)) ** tokens
                          for p in self.popularity) / self.experts
            else:
                hit = 1.0 - (1.0 - self.top_k / self.experts) ** tokens
            self._memo[key] = hit
        return hit

    def resident_seconds(self, block: int, tokens: int, profile: MachineProfile) -> float:
        """Seconds of `block`'s GEMMs at `tokens` tokens per forward with its weights on the device: plain
        weights at the bf16 rate per byte, quantized ones as a dequantizing GEMM (the bf16 GEMM of the
        same weights times `profile.dequant_ratio`)."""
        total = self.block_bytes[block]
        quant = self.quant_bytes[block] if self.quant_bytes else 0
        seconds = 0.0
        for nbytes, m in self.reads(block, tokens):
            share = nbytes / total if total else 0.0  # routed reads touch the same mix of tensors
            seconds += profile.resident_seconds(nbytes - quant * share, m)
            if quant:
                seconds += profile.resident_seconds(self.quant_bf16_bytes[block] * share, m) * \
                    profile.dequant_ratio(m)
        return seconds

    def experts_apart(self, block: int) -> bool:
        """Whether `block`'s routed expert tensors can be read in place apart from the rest of it: it has
        some, and other tensors beside them."""
        return bool(self.routed_tensors and self.routed_tensors[block]
                    and len(self.routed_tensors[block]) < len(self.tensor_bytes[block]))

    def uva_bytes(self, block: int, experts_only: bool = False) -> int:
        """Bytes of `block` read in place from host memory: all of it, or (`experts_only`) its routed
        expert tensors."""
        return self.routed_bytes[block] if experts_only else self.block_bytes[block]

    def routed_wire_ratio(self, block: int) -> float:
        """Predicted bytes on the wire over raw bytes of `block`'s routed expert tensors compressed (one
        blob per expert: each tensor's share of a whole-tensor coding); 1.0 without `tensor_wire`."""
        if not self.tensor_wire or not self.routed_bytes or not self.routed_bytes[block]:
            return 1.0
        at = self.routed_tensors[block]
        return sum(self.tensor_wire[block][j] for j in at) / sum(self.tensor_bytes[block][j] for j in at)

    def expert_landing_bytes(self, blocks: tuple[int, ...]) -> int:
        """Bytes of a landing buffer for coded expert copies of `blocks`: the largest expert's predicted
        blob (its rows of every routed tensor compressed, plus a header) plus 1%."""
        if not blocks:
            return 0
        from ..wire.codec import CHUNK

        def blob(i: int) -> float:  # each tensor's rows padded to whole chunks, as coded_bytes counts them
            wire = self.tensor_wire[i] if self.tensor_wire else self.tensor_bytes[i]
            size = 0.0
            for j in self.routed_tensors[i]:
                row = self.tensor_bytes[i][j] // self.experts
                padded = -(-row // (2 * CHUNK)) * 2 * CHUNK
                size += padded * wire[j] / self.tensor_bytes[i][j] + 8 * (padded // (2 * CHUNK) + 8)
            return size

        return -(-(int(max(blob(i) for i in blocks) * 1.01) + 4096) // 256) * 256

    def cache_hit(self, slots: int) -> float:
        """The share of routed expert reads a GPU expert cache of `slots` slots per layer serves: the
        popularity of the `slots` most popular experts (`popularity`), slots / experts under uniform
        routing."""
        if not self.experts or slots <= 0:
            return 0.0
        if self.popularity:
            return min(1.0, sum(self.popularity[:slots]))
        return min(1.0, slots / self.experts)

    def cache_bytes(self, blocks: tuple[int, ...], slots: int) -> int:
        """Device bytes of a GPU expert cache of `slots` slots for each of `blocks`: their pools (each
        slot a row of every routed tensor), plus one work buffer per distinct set of routed tensor sizes
        (the layers that share it run one after another)."""
        if not blocks:
            return 0
        pools = sum(self.routed_bytes[i] // self.experts * slots for i in blocks)
        work = {tuple(self.tensor_bytes[i][j] for j in self.routed_tensors[i]) for i in blocks}
        return pools + sum(pack(list(sizes))[1] for sizes in work)  # each set in one buffer, packed

    def uva_staging(self, block: int, experts_only: bool = False) -> int:
        """Host bytes of `block`'s zero-copy region (aligned layout): all of it, or its routed experts."""
        if not experts_only:
            return self.staging(block)
        key = ("uva_staging", block)
        if key not in self._memo:
            sizes = [self.tensor_bytes[block][i] for i in self.routed_tensors[block]]
            self._memo[key] = pack(sizes)[1] if self.slot_bytes else sum(sizes)
        return self._memo[key]

    def link_reads(self, block: int, tokens: int, experts_only: bool = False) -> float:
        """Expected bytes a zero-copy `block` reads over the link in a forward of `tokens` tokens: its
        dense bytes in full (none when `experts_only`: they are resident) plus its routed expert bytes
        times the share of experts any token reaches (top_k / experts at one token)."""
        dense, *routed = self.reads(block, tokens)
        return (0.0 if experts_only else dense[0]) + sum(nbytes for nbytes, _ in routed)

    def streamed_bytes(self, block: int, part: int = 0) -> int:
        """Bytes of `block` that stream when its `part` largest tensors do (0: the whole block)."""
        if not part or not self.tensor_bytes:
            return self.block_bytes[block]
        key = ("streamed", block, part)
        if key not in self._memo:
            sizes = self.tensor_bytes[block]
            self._memo[key] = sum(sizes[i] for i in largest(sizes, part))
        return self._memo[key]

    def wire_bytes(self, block: int, part: int = 0) -> int:
        """Predicted bytes on the wire of `block` compressed (its `part` largest tensors; 0: all)."""
        if not self.tensor_wire:
            return self.streamed_bytes(block, part)
        key = ("wire", block, part)
        if key not in self._memo:
            wire = self.tensor_wire[block]
            self._memo[key] = sum(wire[i] for i in largest(self.tensor_bytes[block], part)) + 64  # + header
        return self._memo[key]

    def staging(self, block: int, part: int = 0) -> int:
        """Bytes a slot needs to stage `block` (its `part` largest tensors; 0: all of it)."""
        if part and self.tensor_bytes:
            key = ("staging", block, part)
            if key not in self._memo:
                sizes = [self.tensor_bytes[block][i] for i in largest(self.tensor_bytes[block], part)]
                # aligned like slot_bytes, or not
                self._memo[key] = pack(sizes)[1] if self.slot_bytes else sum(sizes)
            return self._memo[key]
        return self.slot_bytes[block] if self.slot_bytes else self.block_bytes[block]


@dataclass(frozen=True)
class Prediction:
    """Predicted milliseconds of one forward, and what bounds it."""

    ms: float  # a forward entered with nothing staged: the first call, a CUDA graph replay
    compute_ms: float  # every block and the head computed with resident weights
    link_ms: float  # bytes over the link in such a forward: copies plus zero-copy reads
    bound: str  # "link" or "compute"
    # each further forward of the same order called right after the last (eager or compiled without
    # CUDA graphs: the last releases of one forward start the next one's first copies)
    warm_ms: float | None = None
    # expected bytes over the link in a forward entered with nothing staged: copies plus zero-copy
    # reads (routed experts counted at the share of them the tokens reach)
    link_bytes: float = 0.0

    @property
    def again_ms(self) -> float:
        """Milliseconds of each further forward (`warm_ms`, else `ms`)."""
        return self.ms if self.warm_ms is None else self.warm_ms

    def calls_ms(self, calls: int) -> float:
        """Predicted milliseconds of `calls` forwards one after another: the first cold, the rest warm."""
        return 0.0 if calls <= 0 else self.ms + (calls - 1) * self.again_ms


def _same_before(n: int, width: int, k: int) -> int | None:
    """The last global group before global group `k` that uses the same one of `width` slots (or
    landing buffers) when groups 0..n-1 run again and again (group k % n; group g uses g % width);
    None before the first forward."""
    g = k % n
    for back in range(1, n + 1):
        j = k - back
        if j < 0:
            return None
        if (j % n) % width == g % width:
            return j
    return None


def predict(
    model: ModelCost,
    streamed: tuple[int, ...],
    n_slots: int,
    uva: tuple[int, ...],
    tokens: int,
    profile: MachineProfile,
    part: int = 0,
    compressed: bool = False,
    n_landing: int | None = None,
    uva_experts: tuple[int, ...] = (),
    expert_cache: tuple[int, ...] = (),
    expert_slots: int = 0,
    expert_copies: tuple[int, ...] = (),
    coded_copies: bool = False,
) -> Prediction:
    """Predict one forward of `tokens` tokens with blocks `streamed` (through `n_slots` slots; each
    streams its `part` largest tensors, 0: all of it) and `uva` (zero copy), the rest resident: the
    first one (`ms`) and each one after it (`warm_ms`: the second of two simulated back to back, whose
    last releases also start the raw copies of a third, which its last zero-copy reads wait for).

    Raw groups are copied into their slot once compute released it: in the first forward the first
    group of each slot when compute reaches group 0 (the prologue), then each group when the group
    before it in its slot is released; across forwards too (`schedule.py`), so the next forward's
    first groups are copied behind this one's last ones, in that forward's run order (each once its
    slot is free and the ones before it are copied). A group alone in its slot stays there after the
    first forward. A zero-copy block before the first streamed one waits for those early copies.
    Compressed groups follow `wire.py`: group h's blob is copied into landing
    buffer h % `n_landing` (None: two with one slot, else one per slot) once that buffer's last decode
    is done, issued when the group before it in the same slot starts (so up to two groups ahead of
    compute); copies run one after another on the link. A decode fills the slot at the profile's
    decode rate, but it does not overlap compute: measured on the H200
    (docs/diagnostics.md), a decode enqueued beside busy GEMMs lengthens them by more
    than its own time, and in a Flux step every decode ran only once compute was idle. So a group's
    decode starts once its blob has landed, the decode before it is done and compute has reached the
    group, and compute waits for it.

    Blocks of `uva_experts` (a subset of `uva`) read only their routed experts in place: their other
    GEMMs run at the resident rate first (attention and router come before the experts), then the
    routed share crosses the link. Blocks of `expert_cache` (a subset of `uva_experts`) copy their
    routed experts into a work buffer before the GEMMs read them resident: the cached share
    (`ModelCost.cache_hit` of `expert_slots`: uniform routing, or the model's `popularity`) from the
    device, the rest read in place once (at the one-token zero-copy rate, whatever the tokens), plus
    the table update and gather's own `profile.expert_gather_seconds`. Blocks of `expert_copies` (a
    subset of `uva_experts`) wait for the host to read their routing (`profile.expert_sync_seconds`),
    then copy the routed experts over the link at the copy rate and read them resident; `coded_copies`:
    copy their blobs (`ModelCost.routed_wire_ratio` of the bytes), each expert's decode overlapping the
    next one's copy, so a layer waits for the decode of its last expert after its copies."""
    group_of = {block: g for g, block in enumerate(streamed)}
    extra = profile.block_extra_seconds(model.width, tokens)  # every block, wherever its weights are
    on_device = model.block_seconds(tokens, profile)  # each block's seconds, its weights resident
    uva_set = set(uva)
    experts_only = set(uva_experts)
    cached = set(expert_cache)
    copied = set(expert_copies)
    miss = 1.0 - model.cache_hit(expert_slots) if cached else 1.0
    n = len(streamed)
    n_buffers = n_landing or (2 if n_slots == 1 and n > 1 else n_slots)
    # global group k = forward * n + group; where the group before k in its slot is k's own previous
    # forward, k never leaves its slot (no copy, no decode)
    forwards = 2
    before = [_same_before(n, n_slots, k) for k in range((forwards + 1) * n)]
    stays = [b is not None and b == k - n for k, b in enumerate(before)]
    following: list[int | None] = [None] * len(before)  # the global group after k in k's slot
    for k, b in enumerate(before):
        if b is not None:
            following[b] = k
    landed: dict[int, float] = {}  # global group -> time its bytes have crossed the link
    released: dict[int, float] = {}  # global group -> time compute released its slot
    buffer_free: dict[int, float] = {}  # landing buffer -> time its last decode ended
    waiting: set[int] = set()  # the next forward's first groups whose slots are free, not yet started
    started: dict[int, float] = {}  # the next forward's first groups -> when they were started
    lead_issued: dict[int, float] = {}  # compressed: when their blobs were sent (ahead, or at start)
    compute = copy = decode = prologue = 0.0
    link = [0.0] * (forwards + 1)
    link_bytes = [0.0] * (forwards + 1)
    ends = []

    def land(k: int, not_before: float) -> None:
        nonlocal copy
        block = streamed[k % n]
        nbytes = model.wire_bytes(block, part) if compressed else model.streamed_bytes(block, part)
        seconds = profile.copy_seconds(nbytes)
        copy = max(copy, not_before) + seconds
        link[k // n] += seconds
        link_bytes[k // n] += nbytes
        landed[k] = copy

    def start_of(k: int) -> float:
        """When group k is started into its slot (its copy, or its decode): in the prologue, at the
        release of the group before it in its slot, or, for the next forward's first groups, when
        their turn comes (`started`)."""
        if k in started:
            return started[k]
        return prologue if before[k] is None else released[before[k]]

    def first_of_later_forward(k: int) -> bool:
        """Whether global group k is one of a later forward's first groups (one per slot)."""
        return k >= n and k % n < min(n_slots, n)

    def blob_issue(k: int) -> float | None:
        """When the engine sends compressed `k`'s blob (None: not decided yet at this point of the
        simulation): at the start of the group before it in its slot (copied ahead; for a later
        forward's first groups only once the ones before them in its run order were sent, else at
        their own start), or in the prologue for the first forward's first round."""
        try:
            if first_of_later_forward(k):
                early = start_of(before[k]) if before[k] is not None else None
                prior = [lead_issued.get(j) for j in range(k - k % n, k) if not stays[j]]
                if early is not None and all(t is not None and t <= early for t in prior):
                    return early
                return started.get(k)
            return prologue if before[k] is None else start_of(before[k])
        except KeyError:  # its issuing release has not happened yet
            return None

    def land_ahead(k: int) -> None:
        """Compressed `k`'s blob over the link, once issued and once its landing buffer's last decode
        is done."""
        if stays[k]:
            return
        issued = blob_issue(k)
        if first_of_later_forward(k):
            lead_issued[k] = issued
        land(k, max(issued, buffer_free.get((k % n) % n_buffers, 0.0)))

    def gemm_seconds(rate, block: int) -> float:
        return sum(rate(nbytes, m) for nbytes, m in model.reads(block, tokens))

    issued_blobs = 0  # compressed: blobs issued so far, in global order
    last_decoded = -1  # compressed: the last group decoded
    for forward in range(forwards):
        for block in range(len(model.block_bytes)):
            if block in uva_set:  # reads its weights over the link: the link is busy, copies wait
                while compressed and issued_blobs < (forwards + 1) * n:  # blobs sent before it go first
                    h = issued_blobs
                    if not stays[h]:
                        issued = blob_issue(h)
                        if issued is None or issued > compute or h - n_buffers > last_decoded:
                            break  # not sent yet, or its landing buffer still waits for a decode
                        land_ahead(h)
                    issued_blobs += 1
                if block in cached or block in copied:  # dense GEMMs, the routed experts gathered into
                    # the work buffer over the link, routed GEMMs resident
                    (dense, m), *routed = model.reads(block, tokens)
                    if block in cached:  # the misses, each byte read in place once by the gather kernel,
                        nbytes = sum(b for b, _ in routed) * miss  # as a one-token GEMM does
                        seconds = profile.uva_seconds(nbytes, 1)
                        wait, after = 0.0, profile.expert_gather_seconds
                    else:  # every routed expert, by the copy engine once the host has read the routing
                        nbytes = sum(b for b, _ in routed)
                        wait, after = profile.expert_sync_seconds, 0.0
                        if coded_copies:  # the blobs cross; the last expert's decode follows them
                            after = profile.decode_seconds(model.routed_bytes[block] // model.experts)
                            nbytes *= model.routed_wire_ratio(block)
                        seconds = profile.copy_seconds(nbytes)
                    compute += profile.resident_seconds(dense, m) + wait
                    compute = copy = max(compute, copy) + seconds
                    link[forward] += seconds
                    link_bytes[forward] += nbytes
                    compute += sum(profile.resident_seconds(b, m) for b, m in routed) + extra + after
                    continue
                if block in experts_only:  # dense GEMMs on resident weights, then the routed reads
                    (dense, m), *routed = model.reads(block, tokens)
                    compute += profile.resident_seconds(dense, m)
                    seconds = sum(profile.uva_seconds(nbytes, m) for nbytes, m in routed)
                else:
                    seconds = gemm_seconds(profile.uva_seconds, block)
                link_bytes[forward] += model.link_reads(block, tokens, block in experts_only)
                compute = copy = max(compute, copy) + seconds
                link[forward] += seconds
                compute += extra  # the block's other kernels read no weights: the link is free again
                continue
            g = group_of.get(block)
            k = None if g is None else forward * n + g
            if k == 0:  # the prologue, issued when the first forward reaches group 0
                prologue = compute
                if not compressed:
                    for first in range(min(n_slots, n)):
                        land(first, compute)
            if k is not None and stays[k]:
                pass  # staged since the forward before
            elif k is not None and compressed:
                for h in range(issued_blobs, k + 1):  # every blob up to this group's, in issue order
                    land_ahead(h)
                issued_blobs = max(issued_blobs, k + 1)
                decode = max(decode, landed[k], compute) + \
                    profile.decode_seconds(model.streamed_bytes(streamed[g], part))
                compute = decode
                buffer_free[g % n_buffers] = decode
                last_decoded = k
            elif k is not None:
                compute = max(compute, landed[k])
            compute += on_device[block]
            if k is not None:
                released[k] = compute
                # released: the next group of this slot is started (raw: copied), into the next
                # forward too, whose first groups start in its run order
                after = following[k]
                if after is not None and after // n == forward:
                    if not compressed and not stays[after]:
                        land(after, compute)
                elif after is not None:
                    waiting.add(after)
                    base = (forward + 1) * n
                    for j in range(base, base + min(n_slots, n)):
                        if stays[j] or j in started:
                            continue
                        if j in waiting:
                            started[j] = compute
                            if not compressed:
                                land(j, compute)
                        elif g != n - 1:
                            break  # its slot is still in use

        compute += profile.resident_seconds(model.head_bytes, tokens)
        ends.append(compute)
    resident = sum(on_device) + profile.resident_seconds(model.head_bytes, tokens)
    # with nothing streamed every forward is alike (and not a difference of two rounded sums)
    warm = ends[0] if not n else ends[1] - ends[0]
    return Prediction(ends[0] * 1e3, resident * 1e3, link[0] * 1e3,
                      "link" if link[0] >= resident else "compute", warm_ms=warm * 1e3,
                      link_bytes=link_bytes[0])
