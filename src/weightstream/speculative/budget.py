"""One `gpu_memory` for the model and its draft: the target's resident weights, its staging (slots and
landing buffers) and the draft's weights on the GPU, planned together.

A draft's bytes depend on the placement: a self-draft keeps a low-bit copy of every block the model
keeps off the GPU, so the more blocks leave the GPU, the more the draft takes; a draft model's weights
take the same bytes whatever the placement; prompt lookup takes none. `split_placement` lowers the
budget the target's weights are planned with until the placement's GPU bytes plus the draft's bytes
for that placement fit the whole budget (pure logic over the cost model, no CUDA); each step moves the
line down by the excess scaled by how much of a block's bytes its copy takes back, so a few plans
suffice. The KV caches and a verify pass are not in `gpu_memory`, as for `offload` (`generate` checks
them against `cache_memory` or the free memory).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..config import OffloadConfig, config_of, refuse_unsplit_options
from ..errors import ArgumentError, BudgetError
from ..offload import offload
from ..placement.blocks import find_blocks
from ..placement.cost import ModelCost
from ..placement.plan import Placement, plan
from ..placement.prepare import prepare
from ..placement.probe import MachineProfile, load_profile
from ..sizes import format_size
from .draft import resolve_draft
from .draft_model import DraftModel
from .self_draft import SelfDraft

SEARCH_PLANS = 12  # plans a self-draft split tries at most (each about 1 s for 80 blocks on one core)


@dataclass(frozen=True)
class DraftSplit:
    """How one GPU budget is split between the target model's weights and its draft. Sizes in bytes.

    gpu_memory: the whole budget; resident_bytes: the target's weights kept on the GPU; staging_bytes:
    its staging slots and landing buffers; draft_bytes: the draft's weights on the GPU (a self-draft's
    low-bit copies, a draft model's weights; 0 for prompt lookup); drafted_blocks: blocks a self-draft
    copies; placement: the target's placement (planned with `weights_budget` = gpu_memory -
    draft_bytes, what `offload` gets)."""

    gpu_memory: int
    draft: str
    resident_bytes: int
    staging_bytes: int
    draft_bytes: int
    drafted_blocks: int
    placement: Placement

    @property
    def weights_budget(self) -> int:
        """The budget the target's weights are offloaded with: the whole budget less the draft's bytes."""
        return self.gpu_memory - self.draft_bytes

    @property
    def total_bytes(self) -> int:
        """Target resident + staging + draft bytes: at most `gpu_memory`."""
        return self.resident_bytes + self.staging_bytes + self.draft_bytes

    def as_dict(self) -> dict:
        """Plain data (`weightstream plan --json`)."""
        return {"draft": self.draft, "gpu_memory": self.gpu_memory,
                "target_resident_bytes": self.resident_bytes, "staging_bytes": self.staging_bytes,
                "draft_bytes": self.draft_bytes,
                "drafted_blocks": self.drafted_blocks, "weights_budget": self.weights_budget,
                "total_bytes": self.total_bytes}

    def __str__(self) -> str:
        return (f"gpu_memory {format_size(self.gpu_memory)} with the {self.draft} draft: target resident "
                f"{format_size(self.resident_bytes)} + staging {format_size(self.staging_bytes)} + draft "
                f"{format_size(self.draft_bytes)}"
                + (f" ({self.drafted_blocks} blocks)" if self.drafted_blocks else "")
                + f" = {format_size(self.total_bytes)}")


def _draft_bytes(drafter, model: nn.Module, names: list[str], p: Placement,
                 blocks: tuple[str, ...] | None) -> tuple[int, int]:
    """(bytes, blocks drafted low-bit) the draft takes on the GPU when the model is placed by `p`;
    `names` are the model's blocks in the planner's order."""
    if isinstance(drafter, SelfDraft):
        off = [names[i] for i in (*p.streamed, *p.uva)]
        drafted = len(drafter.blocks) if drafter.blocks is not None else len(off)
        return drafter.planned_bytes(model, off, blocks), drafted
    if isinstance(drafter, DraftModel):
        return drafter.weight_bytes(), 0
    return 0, 0  # prompt lookup, no draft: no weights


def split_placement(model: nn.Module, cost: ModelCost, gpu_memory: int, draft: object, *, tokens: int = 1,
                    profile: MachineProfile | None = None, strategy: str = "auto",
                    compress: bool | str = "auto", host_bytes: int | None = None,
                    blocks: tuple[str, ...] | None = None) -> DraftSplit:
    """The target's placement and the draft's bytes that together fit `gpu_memory` bytes (module
    docstring): `cost` is the model's (`prepare(...).cost`), `draft` what `generate(draft=...)` takes
    ("self", a `SelfDraft`, a causal LM or `DraftModel`, "prompt-lookup", None). The other arguments
    are `plan`'s. BudgetError where the draft and the least the model must keep on the GPU do not fit
    together, naming what each needs and the least budget that holds both (plan's own where the model
    alone does not fit, or host memory is the limit)."""
    drafter = resolve_draft(draft)
    names = [b.name for b in find_blocks(model, list(blocks) if blocks is not None else None)]

    def placed(weights: int) -> Placement:
        return plan(cost, weights, tokens, profile, strategy, host_bytes=host_bytes, compress=compress)

    def split(p: Placement) -> DraftSplit:
        need, drafted = _draft_bytes(drafter, model, names, p, blocks)
        return DraftSplit(gpu_memory, drafter.name, p.resident_bytes, p.staging_bytes, need, drafted, p)

    fixed = drafter.weight_bytes() if isinstance(drafter, DraftModel) else 0
    if not isinstance(drafter, SelfDraft):  # the draft's bytes do not depend on the placement
        try:
            return split(placed(gpu_memory - fixed))
        except BudgetError:
            if fixed == 0:
                raise
            placed(gpu_memory)  # plan's own message where the model alone does not fit
            return _refuse(drafter, model, cost, names, gpu_memory, tokens, profile, strategy, compress,
                           host_bytes, blocks, gpu_memory - fixed)
    # a self-draft: search the weights' budget between lo (too small, or fits) and hi (over)
    best: DraftSplit | None = None
    lo, hi = 0, gpu_memory + 1
    tolerance = max(1, min(cost.block_bytes, default=1))  # whole blocks are what a placement moves
    weights = gpu_memory
    for _ in range(SEARCH_PLANS):
        try:
            got = split(placed(weights))
        except BudgetError:
            if weights == gpu_memory:
                raise  # the model alone does not fit: plan's own message
            lo, guess = weights, None
        else:
            over = got.total_bytes - gpu_memory
            if over <= 0:
                if best is None or _faster(got.placement, best.placement):
                    best = got
                lo, guess = weights, None
            else:
                hi = min(weights, got.placement.gpu_bytes)
                # moving x bytes of blocks off the GPU adds x * (draft bytes per byte of a drafted block)
                # to the draft: a step of the excess over what each byte moved frees
                off = sum(cost.block_bytes[i] for i in (*got.placement.streamed, *got.placement.uva))
                back = min(got.draft_bytes / off, 0.9) if off else 0.0
                guess = hi - max(1, int(over / (1 - back)))
        if hi - lo <= tolerance:
            break
        weights = guess if guess is not None and lo < guess < hi else (lo + hi) // 2
    if best is not None:
        return best
    return _refuse(drafter, model, cost, names, gpu_memory, tokens, profile, strategy, compress, host_bytes,
                   blocks, lo)


def _faster(a: Placement, b: Placement) -> bool:
    """Whether the target's forward in placement `a` is predicted faster than in `b` (ms in a loop)."""
    return (a.prediction.again_ms, -a.gpu_bytes) < (b.prediction.again_ms, -b.gpu_bytes)


def _refuse(drafter, model, cost, names, gpu_memory, tokens, profile, strategy, compress, host_bytes, blocks,
            weights) -> DraftSplit:
    """The split of the placement of the fewest GPU bytes where it fits with its draft (a search may step
    past it); else raise: host memory's own BudgetError where it is the limit at `weights`, or the
    draft's (`_too_small`)."""
    if host_bytes is not None and weights >= 0 and _fits_gpu(cost, weights, tokens, profile, strategy,
                                                             compress):
        plan(cost, weights, tokens, profile, strategy, host_bytes=host_bytes, compress=compress)  # raises
    smallest = _smallest(cost, tokens, profile, strategy, compress)
    need, drafted = _draft_bytes(drafter, model, names, smallest, blocks)
    if smallest.gpu_bytes + need <= gpu_memory and host_bytes is None:
        return DraftSplit(gpu_memory, drafter.name, smallest.resident_bytes, smallest.staging_bytes, need,
                          drafted, smallest)
    raise _too_small(drafter, gpu_memory, need, drafted, smallest.gpu_bytes)


def _fits_gpu(cost: ModelCost, weights: int, tokens: int, profile, strategy: str, compress) -> bool:
    """Whether `weights` bytes of GPU hold a placement when host memory is no limit."""
    try:
        plan(cost, weights, tokens, profile, strategy, compress=compress)
    except BudgetError:
        return False
    return True


def _smallest(cost: ModelCost, tokens: int, profile, strategy: str, compress) -> Placement:
    """The placement of the fewest GPU bytes `plan` finds: the one at its stated minimum budget."""
    try:
        return plan(cost, 0, tokens, profile, strategy, compress=compress)
    except BudgetError as err:
        return plan(cost, err.minimum_bytes, tokens, profile, strategy, compress=compress)


def _too_small(drafter, gpu_memory: int, need: int, drafted: int, least: int) -> BudgetError:
    """The BudgetError of a draft of `need` bytes (`drafted` blocks copied) that does not fit beside the
    `least` bytes the model keeps on the GPU."""
    total = least + need
    what = (f"low-bit copies of the {drafted} blocks kept off the GPU" if isinstance(drafter, SelfDraft)
            else "the draft model's weights")
    fixes = (["SelfDraft(bits=4)"] if isinstance(drafter, SelfDraft) and drafter.bits == 8
             else ["a smaller draft model", "draft='self'"] if isinstance(drafter, DraftModel) else [])
    fix = ", ".join(fixes) + (" or " if fixes else "")
    return BudgetError(
        f"gpu_memory={format_size(gpu_memory)} cannot hold the {drafter.name} draft beside the model's "
        f"weights: the draft needs {format_size(need)} ({what}) and the model at least "
        f"{format_size(least)} on the GPU beside it, {format_size(total)} together: give a gpu_memory of at "
        f"least {format_size(total)} ({total} bytes), or draft with {fix}draft='prompt-lookup' (no GPU "
        "memory)", total)


def plan_split(model: nn.Module, gpu_memory: int | str | OffloadConfig, draft: object, *,
               host_bytes: int | None = None, allow_meta: bool = False, **options) -> DraftSplit:
    """Plan `model` and `draft` into one `gpu_memory` (`split_placement`) without moving anything.
    gpu_memory and options: as `offload` takes them (or an `OffloadConfig`); host_bytes: host memory
    for the offloaded weights (as `from_pretrained(cpu_memory=...)`); allow_meta: `model` may be built
    on the meta device (shapes are enough). BudgetError where the draft does not fit beside the model."""
    config = config_of(gpu_memory, **options)
    if config.placement is not None:
        raise ArgumentError("placement=...: a split plans the target's placement itself; give the budget "
                            "and the draft, or offload with your placement and no draft")
    refuse_unsplit_options(config, draft if isinstance(draft, str) else type(draft).__name__)
    profile = load_profile(config.device) if config.profile is None else config.profile
    cost = prepare(model, config.replace(profile=profile), allow_meta=allow_meta, host_bytes=host_bytes).cost
    return split_placement(model, cost, config.gpu_memory, draft, tokens=config.tokens, profile=profile,
                           strategy=config.strategy, compress=config.compress, host_bytes=host_bytes,
                           blocks=config.blocks)


def offload_with_draft(model: nn.Module, gpu_memory: int | str | OffloadConfig, draft: object,
                       **options) -> DraftSplit:
    """Offload `model` so that its weights on the GPU (resident and staging) and the weights of `draft`
    (what `generate(draft=...)` takes) fit one `gpu_memory` together; return the split (bytes).

    The target is offloaded with the placement `plan_split` finds (its weights' budget: `gpu_memory`
    less the draft's bytes); a draft model (an nn.Module or `DraftModel`) is moved to the model's
    device. A self-draft's copies are built at the first `generate` with the same `SelfDraft` (or
    `draft="self"`, int4 in groups of 128): pass it to `generate` as given here. options: as `offload`
    takes them (device, strategy, compress, ...). BudgetError where the draft does not fit beside the
    least the model must keep on the GPU, saying how much both need."""
    config = config_of(gpu_memory, **options)
    split = plan_split(model, config, draft)
    offload(model, config.replace(gpu_memory=split.weights_budget, placement=split.placement))
    drafter = draft.model if isinstance(draft, DraftModel) else draft
    if isinstance(drafter, nn.Module):
        drafter.to(config.device)
    return split
