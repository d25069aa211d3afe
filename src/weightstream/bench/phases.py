"""Phases: what one timed forward is fed, by name. `decode-bN` = 1 new token for each of N sequences
(no KV cache: the step's weight traffic, not attention over a context); `prefill-N` = N tokens of one
sequence; `denoise-bN` = one denoising step of N images or videos (a diffusion shape says how many
tokens one sample is); `generate-N` = a whole greedy generation of N new tokens with a KV cache (eager
only: what `model.generate` does, exact against the resident model's tokens), or, for `--kind
pipeline`, one image generated in N denoising steps.

A new kind of phase (a diffusion model's `denoise-bN` step) is one `PhaseKind` entry in `PHASE_KINDS`;
what a phase's input tensor holds is the model kind's business (`shapes.ModelKind.inputs`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_PHASES = ("decode-b1", "decode-b64", "prefill-2048")


@dataclass(frozen=True)
class Phase:
    """One forward's input: `batch` sequences of `seq` tokens each."""

    name: str
    batch: int
    seq: int
    plan_tokens: int | None = None  # tokens per forward to plan for, where not `tokens` (a generation)

    @property
    def tokens(self) -> int:
        """Tokens per forward (a generation: its new tokens): what tokens/s counts."""
        return self.batch * self.seq

    @property
    def planned(self) -> int:
        """Tokens per forward the methods are planned for: `tokens`, or a generation's one new token per
        sequence and step."""
        return self.tokens if self.plan_tokens is None else self.plan_tokens

    @property
    def kind(self) -> str:
        """The phase kind's name (`decode`, `prefill`): the name up to its first dash."""
        return self.name.split("-", 1)[0]


@dataclass(frozen=True)
class PhaseKind:
    """A family of phases with a number in their name: `pattern` (one regex group, the number N > 0)
    and `make(name, N) -> Phase`."""

    syntax: str  # as the user writes it, e.g. "decode-bN"
    pattern: str
    make: Callable[[str, int], Phase]
    about: str


PHASE_KINDS = (
    PhaseKind("decode-bN", r"decode-b(\d+)", lambda name, n: Phase(name, n, 1), "1 token, batch N"),
    PhaseKind("prefill-N", r"prefill-(\d+)", lambda name, n: Phase(name, 1, n), "N tokens, batch 1"),
    # tokens per sample come from the shape: its model kind's `resolve` fills them in (diffusion.py)
    PhaseKind("denoise-bN", r"denoise-b(\d+)", lambda name, n: Phase(name, n, 1),
              "one denoising step of N samples (diffusion shapes)"),
    # a model kind with a `generate` (causal and encoder-decoder LMs) runs it; eager only (runner.py)
    PhaseKind("generate-N", r"generate-(\d+)", lambda name, n: Phase(name, 1, n, plan_tokens=1),
              "a greedy generation of N new tokens, KV cache, eager only (--kind pipeline: N denoising "
              "steps)"),
)


def parse_phase(name: str) -> Phase:
    """The phase of a name from `PHASE_KINDS`: `decode-bN` (1 token, batch N), `prefill-N` (N tokens,
    batch 1), `denoise-bN`, `generate-N`. Raises ValueError saying how to write one."""
    for kind in PHASE_KINDS:
        match = re.fullmatch(kind.pattern, name)
        if match and int(match.group(1)) > 0:
            return kind.make(name, int(match.group(1)))
    known = " or ".join(f"{k.syntax} ({k.about})" for k in PHASE_KINDS)
    raise ValueError(f"phase {name!r}: write {known}")
