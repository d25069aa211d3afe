"""The tree shape (width, depth) that maximises predicted tokens per millisecond. Pure logic, no CUDA.

The acceptance model: each drafted level of one token is accepted with probability `a` (per draft
kind, `PRIOR_ACCEPTANCE`), independently of the others; a level of `width` alternatives is accepted when
any of them is, with probability a_w = 1 - (1 - a)^width; level d is accepted only when levels 1..d-1
are. So a tree `depth` levels deep accepts E = a_w + a_w^2 + ... + a_w^depth drafted tokens per pass in
expectation, and a pass emits 1 + E tokens. A pass costs one verify forward over 1 + width * depth
tokens (`verify_ms`) plus the draft's steps (`draft_step_ms`): one over the root (`root` tokens: 1 for
a self-draft, 2 for a draft model, whose cache lags one token) that proposes the first level, then one
of `width` tokens for each further level, so the objective is

    (1 + E) / (verify_ms(1 + width * depth) + draft_step_ms(root) + (depth - 1) * draft_step_ms(width))

tokens per ms.

A link-bound verify forward costs about the same at 1 token as at hundreds, so the objective grows with
the tree; a compute-bound one grows with the tree's tokens, so a small tree wins. `estimate_acceptance`
turns the accepted counts of passes of one shape back into `a` (the maximum-likelihood a_w of a
geometric walk cut at `depth`, blended with the prior as `prior_passes` pseudo-passes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import ArgumentError

# per-level acceptance `a` of one drafted token, before anything is measured: the `a` whose model above
# best fits (least squares of log(1 + E)) the mean drafted tokens accepted per pass measured on trained
# weights in fp32, 4x6 and 4x16 trees, SmolLM2-135M and Gemma-3-270M (docs/speculative.md): prompt lookup
# 0.25, 0.81, 2.21, 2.07, 5.95 -> 0.24; self int4 g128 2.92, 3.72, 4.89, 5.52, 11.38 -> 0.44; self int8
# g128 5.12, 5.39, 5.52, 10.94, 14.01 -> 0.58. Prompt lookup's acceptance comes in bursts (a copied span
# is accepted whole), which this model fits least. A draft model: not measured, set below the self-drafts
PRIOR_ACCEPTANCE = {"prompt-lookup": 0.24, "self-int4": 0.44, "self-int8": 0.58, "model": 0.4}
WIDTHS = tuple(range(1, 9))  # candidate widths (tokens per level)
# candidate depths (levels below the root): a 4x16 tree accepted 10.9-14.0 drafted tokens per pass with
# int8 self-drafts of SmolLM2-135M and Gemma-3-270M (5.4-5.5 of 6 at 4x6), and a CUDA-graph draft step
# costs 0.11-0.14 of an 8B verify pass at 25% (docs/speculative.md): deep trees pay where drafts agree
DEPTHS = tuple(range(1, 25))
MAX_TREE_TOKENS = 128  # candidate trees of at most this many tokens (root included)


@dataclass(frozen=True)
class ShapeChoice:
    """A chosen tree shape and what the cost model predicts of it. Times in ms, rates in tokens/s."""

    width: int
    depth: int
    acceptance: float  # per-level acceptance `a` of one drafted token the choice assumed
    expected_accepted: float  # drafted tokens accepted per pass, in expectation
    verify_ms: float  # one verify forward over 1 + width * depth tokens
    draft_ms: float  # the draft's steps of one pass: the root's, then depth - 1 of width tokens

    @property
    def tokens(self) -> int:
        """Tokens of one verify forward."""
        return 1 + self.width * self.depth

    @property
    def tokens_per_second(self) -> float:
        """Predicted tokens per second of the decode passes (prefill left out)."""
        return (1 + self.expected_accepted) / (self.verify_ms + self.draft_ms) * 1e3


def level_acceptance(a: float, width: int) -> float:
    """Probability that a level of `width` drafted alternatives holds the model's token, each one
    accepted with probability `a`: 1 - (1 - a)^width."""
    return 1.0 - (1.0 - a) ** width


def expected_accepted(a: float, width: int, depth: int) -> float:
    """Drafted tokens a tree `width` x `depth` has accepted per pass in expectation (module docstring)."""
    p = level_acceptance(a, width)
    return sum(p ** d for d in range(1, depth + 1))


def draft_pass_ms(width: int, depth: int, draft_step_ms: Callable[[int], float], root: int = 1) -> float:
    """The draft's ms of one pass of a tree `width` x `depth`: a step over the `root` tokens, then
    `depth` - 1 steps of `width` tokens (module docstring)."""
    return draft_step_ms(root) + (depth - 1) * draft_step_ms(width) if depth else 0.0


def objective(a: float, width: int, depth: int, verify_ms: Callable[[int], float],
              draft_step_ms: Callable[[int], float], root: int = 1) -> float:
    """Predicted tokens per ms of a tree `width` x `depth`: (1 + expected accepted) / (verify ms at
    1 + width * depth tokens + the draft's steps, `draft_pass_ms`)."""
    cost = verify_ms(1 + width * depth) + draft_pass_ms(width, depth, draft_step_ms, root)
    return (1 + expected_accepted(a, width, depth)) / cost


def candidates(widths: Sequence[int] = WIDTHS, depths: Sequence[int] = DEPTHS,
               max_tokens: int = MAX_TREE_TOKENS) -> list[tuple[int, int]]:
    """The (width, depth) pairs considered: every width and depth given whose tree has at most
    `max_tokens` tokens (root included)."""
    return [(w, d) for w in widths for d in depths if 1 + w * d <= max_tokens]


def choose_shape(a: float, verify_ms: Callable[[int], float], draft_step_ms: Callable[[int], float],
                 widths: Sequence[int] = WIDTHS, depths: Sequence[int] = DEPTHS,
                 max_tokens: int = MAX_TREE_TOKENS, root: int = 1) -> ShapeChoice:
    """The candidate shape (`candidates`) of the highest `objective`; ties go to the fewer tokens, then
    the narrower tree. a: per-level acceptance of one drafted token, in [0, 1]. verify_ms(tokens): ms of
    a verify forward over that many tokens; draft_step_ms(tokens): ms of one draft step of that many
    tokens (0 for prompt lookup); root: the tokens of the draft's first step. ArgumentError where no
    candidate is left or `a` is out of range."""
    if not 0.0 <= a <= 1.0:
        raise ArgumentError(f"acceptance {a!r}: give a probability between 0 and 1")
    shapes = candidates(widths, depths, max_tokens)
    if not shapes:
        raise ArgumentError(f"no tree of widths {list(widths)} and depths {list(depths)} has at most "
                            f"{max_tokens} tokens: allow a smaller depth or width")
    verify = {n: verify_ms(n) for n in sorted({1 + w * d for w, d in shapes})}
    step = {w: draft_step_ms(w) for w in sorted({root, *(w for w, _ in shapes)})}
    best = max(shapes, key=lambda s: (objective(a, *s, verify.__getitem__, step.__getitem__, root),
                                      -(1 + s[0] * s[1]), -s[0]))
    w, d = best
    return ShapeChoice(w, d, a, expected_accepted(a, w, d), verify[1 + w * d],
                       draft_pass_ms(w, d, step.__getitem__, root))


def estimate_acceptance(accepted: Sequence[int], width: int, depth: int, prior: float,
                        prior_passes: float = 4.0) -> float:
    """Per-level acceptance `a` of one drafted token from the drafted tokens accepted in passes of a
    `width` x `depth` tree: each pass is a walk that accepts levels until the first rejection, cut at
    `depth`, so a_w = accepted levels / (accepted levels + rejections), with the `prior` counted as
    `prior_passes` passes of one level each; then a = 1 - (1 - a_w)^(1 / width)."""
    if depth < 1 or width < 1:
        return prior
    p0 = level_acceptance(prior, width)
    levels = sum(accepted) + prior_passes * p0
    rejections = sum(1 for k in accepted if k < depth) + prior_passes * (1 - p0)
    p = levels / (levels + rejections) if levels + rejections > 0 else p0
    return 1.0 - (1.0 - p) ** (1.0 / width)
