"""`OffloadConfig`: how to offload, validated once.

`offload`, `from_pretrained`, the pipeline path and the command line all build one (from their
keyword arguments, or take one given), so every argument is checked here and nowhere else, with one
message per mistake that says what to change; the engine and the planner then read plain, resolved
values (bytes, a `torch.device`, a bool).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from .devices import resolve_device
from .errors import ArgumentError
from .placement.plan import STRATEGIES, Placement, check_routing_skew
from .placement.probe import MachineProfile
from .sizes import parse_size

CHECK_ENV = "WEIGHTSTREAM_CHECK"
# gpu_memory="auto": the GPU's free memory minus this headroom (activations, KV caches, the CUDA context,
# other work): the larger of AUTO_HEADROOM_BYTES and AUTO_HEADROOM_FRACTION of the GPU's memory
AUTO_HEADROOM_BYTES = 2 * 2**30
AUTO_HEADROOM_FRACTION = 0.10


def auto_gpu_memory(device: torch.device) -> int:
    """`gpu_memory="auto"` on `device` (a CUDA device with its index): its free memory now, minus the
    headroom. A model already on this GPU counts as used: move it to the CPU first, or give a size."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0, free - max(AUTO_HEADROOM_BYTES, int(AUTO_HEADROOM_FRACTION * total)))

__all__ = ["CHECK_ENV", "DEFAULTS", "OffloadConfig", "config_of", "refuse_unsplit_options"]


@dataclass(frozen=True)
class OffloadConfig:
    """How to offload a model (what `weightstream.offload` documents for each argument).

    Built from what a user writes and resolved on construction: `gpu_memory` becomes bytes ("6GiB" ->
    6442450944; "auto", the default: the GPU's free memory minus max(2 GiB, 10% of its memory)),
    `device` a `torch.device` (None: cuda where available), `check` a bool
    (None: the environment variable WEIGHTSTREAM_CHECK), `compress="auto"` False on the CPU backend,
    `blocks` and `keep_resident` tuples. A mistake raises `ArgumentError` saying what to change.
    `replace(**changes)` gives a copy with some fields changed, validated again.

        config = weightstream.OffloadConfig("6GiB", compress=False)
        weightstream.offload(model, config)
    """

    gpu_memory: int | str = "auto"
    device: str | torch.device | None = None
    pin_memory: bool = True
    strategy: str = "auto"
    compress: bool | str = "auto"
    tokens: int = 1
    profile: MachineProfile | None = None
    check: bool | None = None
    blocks: Sequence[str] | None = None
    keep_resident: Collection[str] = ()
    placement: Placement | None = None
    expert_cache: bool = True
    routing_skew: float | None = None
    expert_copies: bool = False

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "device", resolve_device(self.device, index=False))  # the index: when it offloads
        if isinstance(self.gpu_memory, str) and self.gpu_memory.strip().lower() == "auto":
            if self.device.type != "cuda":
                raise ArgumentError("gpu_memory='auto' is the GPU's free memory minus headroom; the CPU "
                                    "backend has no GPU: give a size, e.g. gpu_memory='1GiB'")
            put(self, "gpu_memory", auto_gpu_memory(resolve_device(self.device)))
        put(self, "gpu_memory", parse_size(self.gpu_memory))
        if not isinstance(self.pin_memory, bool):
            raise ArgumentError(f"pin_memory={self.pin_memory!r}: give True or False")
        if self.strategy not in STRATEGIES:
            raise ArgumentError(f"strategy={self.strategy!r}: choose one of {', '.join(STRATEGIES)}")
        if self.compress not in (True, False, "auto") or not isinstance(self.compress, bool | str):
            raise ArgumentError(f"compress={self.compress!r}: choose True, False or 'auto'")
        if self.compress == "auto" and self.device.type != "cuda":
            put(self, "compress", False)  # no link to save on the CPU backend
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
            raise ArgumentError(
                f"tokens={self.tokens!r}: give the tokens per forward to optimize for, an int >= 1")
        if self.strategy == "uva" and self.device.type == "cuda" and not self.pin_memory:
            raise ArgumentError(
                "strategy='uva' reads pinned host memory in place: it needs pin_memory=True")
        if self.profile is not None and not isinstance(self.profile, MachineProfile):
            raise ArgumentError(
                f"profile={type(self.profile).__name__}: give a weightstream.MachineProfile (e.g. "
                "weightstream.REFERENCE_PROFILE, or MachineProfile.from_json of a `weightstream probe` "
                "cache)")
        if self.check is None:
            put(self, "check", os.environ.get(CHECK_ENV, "") not in ("", "0"))
        elif not isinstance(self.check, bool):
            raise ArgumentError(f"check={self.check!r}: give True, False or None (the environment variable "
                                f"{CHECK_ENV})")
        for name in ("blocks", "keep_resident"):
            value = getattr(self, name)
            if isinstance(value, str):
                example = "['model.layers']" if name == "blocks" else "['layers.0.attn.k_cache']"
                raise ArgumentError(f"{name}={value!r}: give a list of names, e.g. {example}")
        if self.blocks is not None:
            put(self, "blocks", tuple(self.blocks))
        put(self, "keep_resident", tuple(self.keep_resident))
        if not isinstance(self.expert_cache, bool):
            raise ArgumentError(f"expert_cache={self.expert_cache!r}: give True (a GPU expert cache where "
                                "the planner predicts it faster) or False (none)")
        if self.routing_skew is not None:
            check_routing_skew(self.routing_skew)
        if not isinstance(self.expert_copies, bool):
            raise ArgumentError(f"expert_copies={self.expert_copies!r}: give True (routed experts copied by "
                                "the copy engine once the host has read the routing: eager and compiled "
                                "forwards, no CUDA graphs) or False (read in place, or through a cache)")
        if self.placement is not None and not isinstance(self.placement, Placement):
            raise ArgumentError(f"placement={type(self.placement).__name__}: give a weightstream.Placement "
                                "(plan.placement_of makes one) or None to let the planner choose")

    def replace(self, **changes) -> OffloadConfig:
        """A copy with `changes`, validated again."""
        return dataclasses.replace(self, **changes)


DEFAULTS = {f.name: f.default for f in dataclasses.fields(OffloadConfig) if f.name != "gpu_memory"}


def config_of(gpu_memory: int | str | OffloadConfig = "auto", **given) -> OffloadConfig:
    """The config a call means: `gpu_memory` itself when it is an OffloadConfig (then every argument
    in `given` must be at its default), else one built from `gpu_memory` and `given`."""
    if isinstance(gpu_memory, OffloadConfig):
        changed = [name for name, value in given.items() if value is not DEFAULTS[name]
                   and (isinstance(value, torch.device) or value != DEFAULTS[name])]
        if changed:
            raise ArgumentError(f"{', '.join(changed)} given beside an OffloadConfig: set them in the config "
                                f"(config.replace({changed[0]}=...)), or pass gpu_memory instead of it")
        return gpu_memory
    return OffloadConfig(gpu_memory, **given)


def refuse_unsplit_options(config: OffloadConfig, draft: str) -> None:
    """ArgumentError where `config` asks for what the budget split beside a speculative `draft` (its name)
    does not plan: `speculative.budget.split_placement` places the model with a GPU expert cache where
    predicted faster and never with expert copies, so `expert_copies=True` and `expert_cache=False`
    would be dropped."""
    asked = [text for text, on in (("expert_copies=True (--expert-copies)", config.expert_copies),
                                   ("expert_cache=False", not config.expert_cache)) if on]
    if asked:
        raise ArgumentError(f"{' and '.join(asked)} with the {draft} draft: the budget split beside a draft "
                            "plans the model without these; drop them, or the draft (--speculate)")
