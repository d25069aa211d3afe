"""The streaming schedule as a state machine over slots and groups. Pure logic, no CUDA.

Groups are numbered in module order; group g lives in slot g % n_slots (fixed: streamed tensors are
permanent views of their slot). The schedule keeps two things:

- `content[s]`: the group whose bytes slot s holds or is being filled with, or None when unknown. A
  wait trusts a slot only when `content` says it holds the group. Whatever changes slots without the
  host seeing it (a CUDA graph replay; the start or end of a capture, which records copies without
  running them) must call `invalidate()`, after which every slot is unknown.
- `succ[g]`: the group that ran after g last time (learned at each wait that follows a release), so
  later runs prefetch in run order, not module order. Initially: module order, and after the last
  group the first one (the next forward).

A wait whose group its slot holds is a hit. Otherwise the wait enters a pass at that group: its copy
and the copies of the groups that follow it along `succ` (one per other slot) start at once. That is a
prologue when nothing was predicted (the first run, after `invalidate`, or where a pass ended and
another group than the one it began with came next), and a miss when the last release predicted
another group inside the pass (the new order is learned). A miss is a change of the run order
(`WaitPlan.changed`, counted in `changes`; the engine warns only of those) where the group released
last was seen followed by another group before. Other misses come of guesses: succ starts as module
order, so the first passes of a model that runs its blocks otherwise (a UNet, whose mid block is
registered after the up blocks it runs before; a VAE run decoder-only; any model that skips blocks)
copy groups that do not come next. Releasing g starts the copy of the next group along `succ` that
uses g's slot.

A pass is what runs from a prologue on; it ends where the run order comes back to the group the pass
began with (the next forward). Eagerly, prefetching does not stop there: the last releases of one
forward start the copies of the next forward's first groups (along `succ`, so in the order the
forward ran), which then cross the link while the forward's last blocks, its head and whatever the
caller does between calls run. If the next call does not begin where the pass did (an encoder-decoder
whose encoder runs again), that is a new pass, not a miss: those copies were wasted, never wrong. The
learned order is followed everywhere else too, also where it goes back in module order (a UNet's mid
block, registered after the up blocks, runs before them). During a CUDA graph capture, copies stop
where the order goes back in module order (so also where a pass ends), and every copy is joined
there, so a captured pass never depends on what runs before or after it; each capture starts its own
pass (the engine calls `invalidate` when one begins).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WaitPlan:
    """What the engine must do before group `group` computes."""

    group: int
    slot: int
    copies: list[tuple[int, int]] = field(default_factory=list)  # (slot, group) to start, in this order
    hit: bool = True  # the slot holds (or is being filled with) the group already
    # a miss (not a hit although the last release predicted another group) where the run order
    # changed: the group the last release was seen followed by before is not this one (a miss without
    # it comes of guesses: the first passes of a model run out of module order; `Schedule.misses`
    # counts every miss)
    changed: bool = False


@dataclass
class ReleasePlan:
    """What the engine must do after a group computed."""

    copies: list[tuple[int, int]] = field(default_factory=list)  # (slot, group) to start, in this order
    join: bool = False  # the group ends a captured pass: join every copy (a capture must end joined)


class Schedule:
    """Slot-content and run-order bookkeeping for `n_groups` streamed groups through `n_slots` slots."""

    def __init__(self, n_groups: int, n_slots: int) -> None:
        if n_groups and not 1 <= n_slots <= n_groups:
            raise ValueError(f"need 1 <= n_slots <= n_groups, got n_slots={n_slots}, n_groups={n_groups}")
        self.n_groups = n_groups
        self.n_slots = n_slots
        self.succ: list[int] = [(g + 1) % n_groups for g in range(n_groups)]
        self.content: list[int | None] = [None] * n_slots
        self.last_release: int | None = None  # the group the last op released, if the last op was one
        self.pass_start: int | None = None  # the group the current pass began with
        self.copies = 0  # asynchronous copies started
        self.prologues = 0  # waits that entered a pass where nothing was predicted
        self.misses = 0  # waits that found their group unstaged although a group was predicted
        self.misses_last_pass = 0  # misses since the last pass began
        self.changes = 0  # misses where the run order changed (`WaitPlan.changed`)
        self.observed: list[bool] = [False] * n_groups  # succ[g] was seen run, not the initial guess
        # slot -> the next forward's group to copy there once the groups before it in that forward
        # have been copied (their slots are still in use): the next forward's copies go in run order
        self.deferred: dict[int, int] = {}
        self.sent_ahead: set[int] = set()  # the next forward's first groups whose bytes `ahead` sent

    def slot(self, group: int) -> int:
        """Return the slot that stages `group`."""
        return group % self.n_slots

    def invalidate(self) -> None:
        """Forget what the slots hold: a replay or a capture changed them (or pretended to)."""
        self.content = [None] * self.n_slots
        self.last_release = None
        self.pass_start = None
        self.deferred = {}
        self.sent_ahead = set()

    def _next(self, group: int, capturing: bool) -> int | None:
        """The group after `group` in the learned run order; None where a pass ends."""
        nxt = self.succ[group]
        if nxt == self.pass_start or (capturing and nxt <= group):
            return None
        return nxt

    def _ahead(self, group: int, capturing: bool) -> int | None:
        """The group to prefetch after `group`: the next in the learned run order, eagerly also across
        the end of a pass (into the next forward); None where a captured pass ends."""
        return self._next(group, capturing) if capturing else self.succ[group]

    def _firsts(self, group: int | None, capturing: bool) -> list[int]:
        """`group`, then the groups after it along the prefetch order, each while its slot has not
        been given one yet: what a pass entered at `group` copies first."""
        firsts: list[int] = []
        g = group
        for _ in range(self.n_groups):
            if g is None or len(firsts) == self.n_slots:
                break
            if all(self.slot(g) != self.slot(h) for h in firsts):
                firsts.append(g)
            g = self._ahead(g, capturing)
        return firsts

    def _fill(self, group: int, capturing: bool) -> list[tuple[int, int]]:
        """Copies that enter a pass at `group` (`_firsts`), recorded as the slots' content."""
        self.deferred = {}  # slots are being given other groups: nothing waits for them any more
        self.sent_ahead = set()
        copies = [(self.slot(g), g) for g in self._firsts(group, capturing)]
        for s, g in copies:
            self.content[s] = g
        self.copies += len(copies)
        return copies

    def on_wait(self, group: int, capturing: bool = False) -> WaitPlan:
        """Bookkeeping for "group is about to compute"; returns what the engine must do."""
        if not 0 <= group < self.n_groups:
            raise IndexError(f"group {group} out of range 0..{self.n_groups - 1}")
        last, self.last_release = self.last_release, None
        predicted = None if last is None else self._next(last, capturing)
        changed = last is not None and self.observed[last] and self.succ[last] != group
        if last is not None:
            self.succ[last] = group
            self.observed[last] = True
        if group == self.pass_start:
            self.misses_last_pass = 0  # the pass begins again: the next forward
            self.sent_ahead = set()
        plan = WaitPlan(group, self.slot(group))
        if self.content[plan.slot] == group:
            return plan
        plan.hit = False
        if predicted is None:  # a prologue: this group begins a pass
            self.pass_start = group
            self.prologues += 1
            self.misses_last_pass = 0
        else:
            plan.changed = changed
            self.misses += 1
            self.misses_last_pass += 1
            self.changes += changed
        plan.copies = self._fill(group, capturing)
        return plan

    def after(self, group: int, capturing: bool = False) -> int | None:
        """The group expected to be copied into `group`'s slot next, along the learned run order (eagerly
        also into the next forward; `group` itself when no other group uses its slot; None where a
        captured pass ends first)."""
        slot = self.slot(group)
        nxt = self._ahead(group, capturing)
        for _ in range(self.n_groups):
            if nxt is None or self.slot(nxt) == slot:
                return nxt
            nxt = self._ahead(nxt, capturing)
        return None  # the order loops without coming back to this slot

    def ahead(self, group: int, capturing: bool = False) -> int | None:
        """The group whose bytes may start crossing the link now, ahead of its slot, once `group` was
        started into its slot (a compressed group's blob into a free landing buffer; the schedule's
        bookkeeping does not change): `after(group)`. One of the next forward's first groups only once
        every group before it in that forward's run order was started or sent ahead, so their bytes
        cross the link in the order that forward needs them."""
        nxt = self.after(group, capturing)
        if nxt is None or capturing or not self._crosses(group, nxt):
            return nxt
        lead = self._lead()
        if nxt not in lead:
            return None
        for g in lead[: lead.index(nxt)]:
            if self.content[self.slot(g)] != g and g not in self.sent_ahead:
                return None
        return nxt

    def sent(self, group: int) -> None:
        """The transfer did send `group`'s bytes ahead (`ahead` only offers: a raw group, or a landing
        buffer still holding a blob for its decode, sends nothing)."""
        self.sent_ahead.add(group)

    def on_release(self, group: int, capturing: bool = False) -> ReleasePlan:
        """Bookkeeping for "group finished computing"; returns what to copy and whether to join (where a
        captured pass ends; eagerly never: copies into the next forward may be in flight)."""
        if not 0 <= group < self.n_groups:
            raise IndexError(f"group {group} out of range 0..{self.n_groups - 1}")
        self.last_release = group
        slot = self.slot(group)
        ends = self._next(group, capturing) is None  # the last group of the pass
        plan = ReleasePlan(join=capturing and ends)
        nxt = self.after(group, capturing)
        if nxt is None or self.content[slot] == nxt:
            return plan
        lead = self._lead() if not capturing and self._crosses(group, nxt) else []
        if nxt not in lead:  # inside the pass (or an order the lead does not foresee): copy now
            self._issue(plan, slot, nxt)
            return plan
        # the next forward's first groups are copied in its run order, as their slots come free: with
        # an odd number of groups through two slots, the slot of that forward's second group comes free
        # before the slot of its first
        self.deferred[slot] = nxt
        for g in lead:
            s = self.slot(g)
            if self.content[s] == g:
                continue  # copied already, or alone in its slot
            if self.deferred.get(s) == g:
                del self.deferred[s]
                self._issue(plan, s, g)
            elif not ends:
                break  # an earlier group's slot is still in use: later ones wait for it
        return plan

    def _issue(self, plan: ReleasePlan, slot: int, group: int) -> None:
        self.content[slot] = group
        self.copies += 1
        plan.copies.append((slot, group))

    def _crosses(self, group: int, target: int) -> bool:
        """Whether the run order from `group` reaches `target` only through the group the pass began
        with: `target` is in the next forward."""
        g = group
        for _ in range(self.n_groups):
            g = self.succ[g]
            if g == self.pass_start:
                return True
            if g == target:
                return False
        return False

    def _lead(self) -> list[int]:
        """The next forward's first groups, one per slot, in its run order (what a prologue at the
        group the pass began with would copy; used eagerly only)."""
        return self._firsts(self.pass_start, False)
