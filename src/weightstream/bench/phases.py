"""Phases: what one timed forward is fed, by name. `decode-bN` = 1 new token for each of N sequences
(no KV cache: the step's weight traffic, not attention over a context); `prefill-N` = N tokens of one
sequence; `denoise-bN` = one denoising step of N images or videos (a diffusion shape says how many
tokens one sample is).

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

    @property
    def tokens(self) -> int:
        """Tokens per forward: what the planner plans for and what tokens/s counts."""
        return self.batch * self.seq

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
)


def parse_phase(name: str) -> Phase:
    """The phase of a name from `PHASE_KINDS`: `decode-bN` (1 token, batch N) or `prefill-N` (N tokens,
    batch 1). Raises ValueError saying how to write one."""
    for kind in PHASE_KINDS:
        match = re.fullmatch(kind.pattern, name)
        if match and int(match.group(1)) > 0:
            return kind.make(name, int(match.group(1)))
    known = " or ".join(f"{k.syntax} ({k.about})" for k in PHASE_KINDS)
    raise ValueError(f"phase {name!r}: write {known}")
