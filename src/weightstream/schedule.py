"""The streaming schedule as a state machine over slots and groups. Pure logic, no CUDA.

Groups are numbered in module order; group g lives in slot g % n_slots (fixed: streamed tensors are
permanent views of their slot). The schedule keeps two things:

- `content[s]`: the group whose bytes slot s holds or is being filled with, or None when unknown. A
  wait trusts a slot only when `content` says it holds the group. Whatever changes slots without the
  host seeing it (a CUDA graph replay; the start or end of a capture, which records copies without
  running them) must call `invalidate()`, after which every slot is unknown.
- `succ[g]`: the group that ran after g last time (learned at each wait that follows a release), so
  later runs prefetch in run order, not module order. Initially: module order, nothing after the last.

A wait whose group its slot holds is a hit. Otherwise the wait enters a pass at that group: its copy
and the copies of the groups that follow it along `succ` (one per other slot) start at once. That is a
prologue when nothing was predicted (the first run, or after `invalidate`), and a miss when the last
release predicted another group (the run order changed; the new order is learned). Releasing g starts
the copy of the next group along `succ` that uses g's slot.

A pass is what runs from a prologue on; it ends where the run order comes back to the group the pass
began with (the next forward), or stops. Eagerly the learned order is followed everywhere else, also
where it goes back in module order (a UNet's mid block, registered after the up blocks, runs before
them). During a CUDA graph capture, copies also stop where the order goes back in module order, and
every copy is joined where a pass ends, so a captured pass never depends on what runs before or after
it; each capture starts its own pass (the engine calls `invalidate` when one begins).
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
    miss: bool = False  # not a hit although the last release predicted another group


@dataclass
class ReleasePlan:
    """What the engine must do after a group computed."""

    copy: tuple[int, int] | None = None  # (slot, group) to start copying, or None
    join: bool = False  # the group ends a pass: join every copy (a capture must end joined)


class Schedule:
    """Slot-content and run-order bookkeeping for `n_groups` streamed groups through `n_slots` slots."""

    def __init__(self, n_groups: int, n_slots: int) -> None:
        if n_groups and not 1 <= n_slots <= n_groups:
            raise ValueError(f"need 1 <= n_slots <= n_groups, got n_slots={n_slots}, n_groups={n_groups}")
        self.n_groups = n_groups
        self.n_slots = n_slots
        self.succ: list[int | None] = [g + 1 if g + 1 < n_groups else None for g in range(n_groups)]
        self.content: list[int | None] = [None] * n_slots
        self.last_release: int | None = None  # the group the last op released, if the last op was one
        self.pass_start: int | None = None  # the group the current pass began with
        self.copies = 0  # asynchronous copies started
        self.prologues = 0  # waits that entered a pass where nothing was predicted
        self.misses = 0  # waits that found their group unstaged although a group was predicted
        self.misses_last_pass = 0  # misses since the last pass began

    def slot(self, group: int) -> int:
        """Return the slot that stages `group`."""
        return group % self.n_slots

    def invalidate(self) -> None:
        """Forget what the slots hold: a replay or a capture changed them (or pretended to)."""
        self.content = [None] * self.n_slots
        self.last_release = None
        self.pass_start = None

    def _next(self, group: int, capturing: bool) -> int | None:
        """The group after `group` in the learned run order; None where a pass ends."""
        nxt = self.succ[group]
        if nxt is None or nxt == self.pass_start or (capturing and nxt <= group):
            return None
        return nxt

    def _fill(self, group: int, capturing: bool) -> list[tuple[int, int]]:
        """Copies that enter a pass at `group`: it, then the groups after it, each into its slot
        while that slot has not been given one yet."""
        copies: list[tuple[int, int]] = []
        g: int | None = group
        for _ in range(self.n_groups):
            if g is None or len(copies) == self.n_slots:
                break
            s = self.slot(g)
            if all(s != c for c, _ in copies):
                copies.append((s, g))
                self.content[s] = g
            g = self._next(g, capturing)
        self.copies += len(copies)
        return copies

    def on_wait(self, group: int, capturing: bool = False) -> WaitPlan:
        """Bookkeeping for "group is about to compute"; returns what the engine must do."""
        if not 0 <= group < self.n_groups:
            raise IndexError(f"group {group} out of range 0..{self.n_groups - 1}")
        last, self.last_release = self.last_release, None
        predicted = None if last is None else self._next(last, capturing)
        if last is not None:
            self.succ[last] = group
        if group == self.pass_start:
            self.misses_last_pass = 0  # the pass begins again: the next forward
        plan = WaitPlan(group, self.slot(group))
        if self.content[plan.slot] == group:
            return plan
        plan.hit = False
        if predicted is None:  # a prologue: this group begins a pass
            self.pass_start = group
            self.prologues += 1
            self.misses_last_pass = 0
        else:
            plan.miss = True
            self.misses += 1
            self.misses_last_pass += 1
        plan.copies = self._fill(group, capturing)
        return plan

    def after(self, group: int, capturing: bool = False) -> int | None:
        """The group expected to be copied into `group`'s slot next, along the learned run order
        (None where the pass ends first). A transfer may start moving its bytes early (a compressed
        group into a free landing buffer); the schedule's bookkeeping does not change."""
        slot = self.slot(group)
        nxt = self._next(group, capturing)
        for _ in range(self.n_groups):
            if nxt is None or self.slot(nxt) == slot:
                break
            nxt = self._next(nxt, capturing)
        return nxt

    def on_release(self, group: int, capturing: bool = False) -> ReleasePlan:
        """Bookkeeping for "group finished computing"; returns what to copy and whether to join."""
        if not 0 <= group < self.n_groups:
            raise IndexError(f"group {group} out of range 0..{self.n_groups - 1}")
        self.last_release = group
        slot = self.slot(group)
        plan = ReleasePlan(join=self._next(group, capturing) is None)
        nxt = self.after(group, capturing)
        if nxt is None or self.content[slot] == nxt:
            return plan
        self.content[slot] = nxt
        self.copies += 1
        plan.copy = (slot, nxt)
        return plan
