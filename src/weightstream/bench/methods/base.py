"""What a bench method is: a name, a `prepare` that changes the model in place and returns how to undo
it, the modes it supports, and what it needs to run (an import, CUDA)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Undo = Callable[[], None]
Prepare = Callable[..., tuple[dict, Undo]]  # (model, budget_bytes | None, phase_tokens, device)
EAGER_ONLY = "its hooks are torch.compiler.disable'd: fullgraph compile and CUDA graphs fail"


@dataclass(frozen=True)
class Method:
    """An offload method: `prepare(model, budget_bytes, phase_tokens, device) -> (setup_info, undo)`
    changes the model in place so it runs on `device`; `undo()` puts it back where it was.
    setup_info holds at least `link_bytes`, the bytes that cross host->GPU per forward."""

    name: str
    prepare: Prepare
    modes: tuple[str, ...]  # modes it supports
    about: str
    requires: str | None = None  # a module that must import for the method to be registered
    uses_budget: bool = True  # False: measured once per phase, budget_bytes None
    cuda_only: bool = False
    gives_reference: bool = False  # may provide reference outputs (resident, weightstream)
    in_default: bool = True  # run when --methods is not given (variants for one question are not)
