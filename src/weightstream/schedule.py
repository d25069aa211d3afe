"""The streaming schedule as a state machine over slots and groups. Pure logic, no CUDA.

Groups are numbered in forward order; group g lives in slot g % n_slots. Each forward is
self-contained: waiting for group 0 starts the copies of the first n_slots groups (the prologue), and
releasing group g starts the copy of group g + n_slots into the slot g just freed. Nothing is copied
across the end of a forward, so a captured CUDA graph never depends on what ran before it.

The schedule tracks which group each slot holds (or is being filled with). A wait for a group its
slot does not hold (a block called out of order, twice, or after a skipped one) is a miss: the engine
fetches the group synchronously, so stale weights are never used.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WaitPlan:
    """What the engine must do before group `group` computes."""

    group: int
    slot: int
    prologue: list[int] = field(default_factory=list)  # groups to start copying, each into its own slot
    hit: bool = True  # False: the slot holds another group; fetch synchronously


class Schedule:
    """Slot-content bookkeeping for `n_groups` streamed groups staged through `n_slots` slots."""

    def __init__(self, n_groups: int, n_slots: int) -> None:
        if n_groups and not 1 <= n_slots <= n_groups:
            raise ValueError(f"need 1 <= n_slots <= n_groups, got n_slots={n_slots}, n_groups={n_groups}")
        self.n_groups = n_groups
        self.n_slots = n_slots
        self.content: list[int | None] = [None] * n_slots
        self.copies = 0  # asynchronous copies started (prologue and prefetch)
        self.fetches = 0  # synchronous fetches after a miss

    def slot(self, group: int) -> int:
        """Return the slot that stages `group`."""
        return group % self.n_slots

    def on_wait(self, group: int) -> WaitPlan:
        """Bookkeeping for "group is about to compute"; returns what the engine must do."""
        if not 0 <= group < self.n_groups:
            raise IndexError(f"group {group} out of range 0..{self.n_groups - 1}")
        plan = WaitPlan(group, self.slot(group))
        if group == 0:
            plan.prologue = list(range(self.n_slots))
            self.content = list(plan.prologue)
            self.copies += len(plan.prologue)
        plan.hit = self.content[plan.slot] == group
        if not plan.hit:
            self.content[plan.slot] = group
            self.fetches += 1
        return plan

    def on_release(self, group: int) -> int | None:
        """Bookkeeping for "group finished computing"; returns the group to copy into its slot now."""
        nxt = group + self.n_slots
        if nxt >= self.n_groups:
            return None
        self.content[self.slot(group)] = nxt
        self.copies += 1
        return nxt

    def is_last(self, group: int) -> bool:
        """True for the last group of a forward, after which every copy must have been joined."""
        return group == self.n_groups - 1
