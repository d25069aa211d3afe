"""The verify-forward and draft-step ms the placement's cost model predicts, and `generate`'s automatic
tree shape (`width="auto"`, `depth="auto"`) chosen from them (`shape_choice.py`).

An offloaded model's verify forward is predicted for its own placement (`placement.cost.predict`) on
the profile it was planned with (the machine's cached profile; the reference H200 profile on the CPU
backend): a forward in a loop of them (`warm_ms`), or entered with nothing staged (`ms`) where it
replays from a CUDA graph. A resident model is costed with every block resident. A draft step of
`width` tokens: 0 ms for prompt lookup; for a draft model, its own forward as placed; for the
self-draft, the model's forward with every block resident, its drafted blocks (those off the GPU)
costing `SELF_DRAFT_RATIO` times their resident time. A drafted weight is dequantized into a buffer
that the matmul then reads (`quantize.QuantizedWeight`), so it is not cheaper than a resident one:
measured on an H100 from CUDA graphs, the Llama-3-8B shape at 25% (31 of its 32 blocks off the GPU,
drafted in int4, groups of 128: 3.59 GB of copies) took 19.93 ms a one-token draft step
(benchmarks/results/2026-12-07_h100_speculative-graph-step) against 6.69 ms for the resident model's
compiled decode step replayed from a CUDA graph (benchmarks/results/2026-12-07_h100_written-tensors-ab):
3.04x the resident time for the drafted blocks' part. A step of at most `draft_linear.MAX_ROWS` tokens
runs its linear layers through the low-bit matmul instead (`matmul_kernel.py`): 10.60 ms on the same
shape from a captured graph (benchmarks/results/2026-12-07_h100_low-bit-matmul), 1.60x
(`SELF_DRAFT_RATIO_LOW_BIT`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..handle import _HANDLE_ATTR
from ..placement.blocks import find_blocks, module_bytes
from ..placement.plan import Placement, predict_placement
from ..placement.prepare import prepare
from ..placement.probe import load_profile
from .checks import check_tree_argument
from .draft_linear import MAX_ROWS
from .draft_model import DraftModel
from .self_draft import SelfDraft
from .shape_choice import (
    DEPTHS,
    MAX_TREE_TOKENS,
    PRIOR_ACCEPTANCE,
    WIDTHS,
    ShapeChoice,
    candidates,
    choose_shape,
)

# a drafted block's step time over its resident time: (19.93 / 6.69 - 1 / 32) / (31 / 32), int4 g128, one
# token, from CUDA graphs on an H100 (module docstring); int8 copies are taken to cost the same
SELF_DRAFT_RATIO = 3.04
# the same for a step through the low-bit matmul: (10.60 / 6.69 - 1 / 32) / (31 / 32), one token
SELF_DRAFT_RATIO_LOW_BIT = 1.60


def drafted_share(model: nn.Module, drafter: SelfDraft) -> float:
    """The share of `model`'s block bytes `drafter` copies low-bit: the blocks `SelfDraft.block_names`
    gives (those the model keeps off the GPU, every block of a resident model, or the ones it names)."""
    total = sum(module_bytes(b.module) for b in find_blocks(model))
    modules = dict(model.named_modules())
    drafted = sum(module_bytes(modules[name]) for name in drafter.block_names(model))
    return drafted / total if total else 0.0


def _forward_ms(model: nn.Module, replay: bool, resident: bool = False) -> Callable[[int], float]:
    """ms of one forward of `model` at a number of tokens, by the cost model: in its placement where
    it is offloaded, unless `resident` (every block on the device)."""
    handle = getattr(model, _HANDLE_ATTR, None)
    if handle is not None and not handle.restored:
        cost, p = handle._cost, handle.placement
        profile = handle.config.profile if handle.config is not None else None
        profile = profile or load_profile(handle.device)
    else:
        device = model.get_input_embeddings().weight.device
        cost = prepare(model, 0, device=device, placement=Placement((), 0, 0, 0, 0), predict_wire=False).cost
        p, profile = None, load_profile(device)
    if resident or p is None:
        p = Placement((), 0, 0, 0, 0)
    return placement_ms(cost, p, profile, replay)


def placement_ms(cost, p: Placement, profile, replay: bool) -> Callable[[int], float]:
    """ms of one forward at a number of tokens of a model of `cost` placed as `p`, by the cost model on
    `profile`: replayed from a CUDA graph (`replay`, entered with nothing staged) or in a loop."""

    def ms(tokens: int) -> float:
        got = predict_placement(cost, p, tokens, profile)
        return got.ms if replay else got.again_ms

    return ms


def planned_choice(cost, p: Placement, profile, drafter) -> ShapeChoice | None:
    """The tree shape `generate(width="auto", depth="auto")` would choose first, and what it predicts,
    for a model of `cost` placed as `p` (`weightstream plan --speculate`): eager forwards in a loop,
    the draft's prior acceptance; a self-draft drafting the blocks `p` keeps off the GPU. None for a
    draft model (its own forward is not planned here)."""
    if isinstance(drafter, DraftModel):
        return None
    verify_ms = functools.cache(placement_ms(cost, p, profile, False))
    draft_step_ms = _no_draft_step
    if isinstance(drafter, SelfDraft):
        total = sum(cost.block_bytes)
        share = sum(cost.block_bytes[i] for i in (*p.streamed, *p.uva)) / total if total else 0.0
        draft_step_ms = _self_draft_step(placement_ms(cost, Placement((), 0, 0, 0, 0), profile, False), share)
    return choose_shape(prior_acceptance(drafter), verify_ms, draft_step_ms, root=1)


def _self_draft_step(resident_ms: Callable[[int], float], share: float) -> Callable[[int], float]:
    """A self-draft step's ms at a number of tokens: the resident forward's, scaled for `share` of the
    block bytes drafted (`self_draft_scale`)."""
    return lambda tokens: resident_ms(tokens) * self_draft_scale(share, tokens)


def _no_draft_step(tokens: int) -> float:
    """Prompt lookup drafts on the host: no draft step is counted."""
    return 0.0


def prior_acceptance(drafter) -> float:
    """The per-level acceptance `a` assumed before anything is measured (`PRIOR_ACCEPTANCE`)."""
    if isinstance(drafter, SelfDraft):
        return PRIOR_ACCEPTANCE["self-int8" if drafter.bits == 8 else "self-int4"]
    if isinstance(drafter, DraftModel):
        return PRIOR_ACCEPTANCE["model"]
    return PRIOR_ACCEPTANCE["prompt-lookup"]


def _dimension(name: str, value) -> tuple[int, ...] | None:
    """The candidates of one tree dimension: all of them for "auto", None for a fixed value."""
    check_tree_argument(name, value)
    if value == "auto":
        return WIDTHS if name == "width" else DEPTHS
    return None


def self_draft_scale(share: float, tokens: int) -> float:
    """A self-draft step's time over the resident forward's when `share` of the block bytes is drafted
    and the step runs `tokens` tokens (at most `draft_linear.MAX_ROWS`: through the low-bit matmul)."""
    ratio = SELF_DRAFT_RATIO_LOW_BIT if tokens <= MAX_ROWS else SELF_DRAFT_RATIO
    return 1.0 - share + share * ratio


@dataclass(frozen=True)
class AutoShape:
    """What `generate`'s automatic tree shape chooses among and from: the candidate widths and depths
    (trees of at most `max_tokens` tokens), the predicted verify ms at a number of tokens and draft-step
    ms at a width, and the draft's prior per-level acceptance. `choose` picks the shape for an acceptance
    (the prior before anything is measured, `estimate_acceptance` of the passes run after)."""

    widths: tuple[int, ...]
    depths: tuple[int, ...]
    verify_ms: Callable[[int], float]
    draft_step_ms: Callable[[int], float]
    prior: float
    max_tokens: int
    root: int = 1  # tokens of the draft's first step of a pass (2 for a draft model)

    def choose(self, acceptance: float | None = None) -> ShapeChoice:
        """The shape of the highest predicted tokens/ms at `acceptance` (None: the prior)."""
        a = self.prior if acceptance is None else acceptance
        return choose_shape(a, self.verify_ms, self.draft_step_ms, self.widths, self.depths, self.max_tokens,
                            self.root)

    @property
    def plain_tokens_per_second(self) -> float:
        """Predicted tokens/s of plain decoding, one token per verify forward: what a shape must beat."""
        return 1e3 / self.verify_ms(1)

    @property
    def largest(self) -> tuple[int, int]:
        """(the most tokens, the most levels) of any candidate tree: what caches are sized for when the
        shape may be chosen again."""
        shapes = candidates(self.widths, self.depths, self.max_tokens)
        return max(1 + w * d for w, d in shapes), max(d for _, d in shapes)


def auto_shape(model: nn.Module, drafter, width, depth, max_depth: int | None,
               compile: bool | str) -> AutoShape | None:
    """What `generate` chooses its tree from when `width` or `depth` is "auto" (`AutoShape`: verify and
    draft-step ms predicted for `model` and `drafter`, module docstring, and the draft's prior
    acceptance); a fixed dimension stays as given. None when neither is "auto". max_depth: the deepest
    tree the model's positions allow (None: no limit)."""
    widths, depths = _dimension("width", width), _dimension("depth", depth)
    if widths is None and depths is None:
        return None
    widths = widths or (width,)
    depths = depths or (depth,)
    if max_depth is not None:
        depths = tuple(d for d in depths if d <= max_depth) or (min(depths),)
    replay = compile == "reduce-overhead"
    verify_ms = _forward_ms(model, replay)
    if isinstance(drafter, SelfDraft):
        resident_ms = _forward_ms(model, replay, resident=True)
        draft_step_ms = _self_draft_step(resident_ms, drafted_share(model, drafter))
    elif isinstance(drafter, DraftModel):
        draft_step_ms = _forward_ms(drafter.model, replay)
    else:
        draft_step_ms = _no_draft_step
    # a re-choice asks again: predict each tree size once
    return AutoShape(widths, depths, functools.cache(verify_ms), functools.cache(draft_step_ms),
                     prior_acceptance(drafter), max(MAX_TREE_TOKENS, 1 + min(widths) * min(depths)),
                     2 if isinstance(drafter, DraftModel) else 1)
