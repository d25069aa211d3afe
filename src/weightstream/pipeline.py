"""`offload(pipe, gpu_memory=...)` for a diffusers `DiffusionPipeline`: one budget over all its models.

A pipeline is not an `nn.Module`: it holds several (text encoders, a transformer or UNet, a VAE) that
run at different rates. A generation of S steps calls the denoiser S times and each other model once,
so a byte kept resident in the denoiser saves S times what it saves in a text encoder. The planner
therefore plans the components together: for each it lists every placement the cost model knows
(`plan._candidates`), keeps the Pareto front (GPU bytes against predicted ms), weights each front by
the component's calls per generation, and picks the combination of one placement per component that
fits the budget with the least predicted time for the whole generation (an exact merge of the fronts,
not a greedy split). Each component is then offloaded on its own with that placement (`offload(...,
placement=...)`), so every engine guarantee (exactness, compile, graphs) holds per component.

Staging memory is not shared between components that never run at the same time: each component's
slots are its own GPU buffers (docs/diffusion.md says why sharing them is not exact yet).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from .config import OffloadConfig, config_of
from .dtypes import default_dtype
from .errors import ArgumentError, BudgetError, CheckpointError, OffloadStateError
from .handle import OffloadHandle, OffloadStats, offload_module
from .placement.cost import ModelCost
from .placement.plan import Placement, _candidates, choose_disk_groups, landing_options, placement_of, wire_of
from .placement.prepare import prepare
from .placement.probe import MachineProfile, load_profile
from .sizes import format_size, parse_size

DENOISERS = ("transformer", "transformer_2", "unet", "prior", "decoder")  # called once per step
DEFAULT_STEPS = 28
# what `weightstream plan` says where compress="auto" planned raw only because this machine has no CUDA
AUTO_RAW_NOTE = ("compress auto plans raw groups on this machine, which has no CUDA (the planned GPU may "
                 "compress them): --compress true shows them compressed")
DEFAULT_TOKENS = {"denoiser": 4096, "other": 512}  # tokens per forward the cost model plans for
# Tokens per denoiser forward at its pipeline's default generation, by the denoiser's class: what its
# GEMMs and attention see. A model not listed gets DEFAULT_TOKENS["denoiser"] (a 64x64 latent).
DENOISER_TOKENS = {
    # FluxPipeline at 1024x1024: 64x64 packed latent tokens, joint with its 512 T5 tokens
    "FluxTransformer2DModel": 4096 + 512,
    # StableDiffusion3Pipeline at 1024x1024: 64x64 patches, joint with 77 CLIP + 256 T5 tokens
    "SD3Transformer2DModel": 4096 + 77 + 256,
    # WanPipeline at 480x832, 81 frames: 21 latent frames of 30x52 patches (text enters by cross-attention)
    "WanTransformer3DModel": 21 * 30 * 52,
}


def denoiser_tokens(model: nn.Module) -> int:
    """Tokens per forward to plan a denoiser for: its pipeline's default generation (DENOISER_TOKENS),
    else DEFAULT_TOKENS["denoiser"]."""
    return DENOISER_TOKENS.get(type(model).__name__, DEFAULT_TOKENS["denoiser"])


_PIPE_ATTR = "_weightstream_pipeline_handle"
# a pipeline's own offloading, refused on a pipeline weightstream offloaded (accelerate's would move the
# streamed weights to the meta device, past every guard, and leave the pipeline unrestorable)
_REFUSED_AFTER_OFFLOAD = ("enable_sequential_cpu_offload", "enable_model_cpu_offload", "enable_group_offload")


def _refused_after_offload(name: str):
    def refuse(*args, **kwargs):
        raise OffloadStateError(
            f"pipe.{name}() on a pipeline weightstream offloaded: it would move the weights weightstream "
            f"streams. Use one offloader: call handle.restore() first to use {name}")
    return refuse


def is_pipeline(obj) -> bool:
    """True for a diffusers `DiffusionPipeline` (anything not an nn.Module with a `components` dict)."""
    return not isinstance(obj, nn.Module) and isinstance(getattr(obj, "components", None), dict)


def modules_of(pipe) -> dict[str, nn.Module]:
    """The pipeline's nn.Module components by name (tokenizers, schedulers and None left out)."""
    return {name: m for name, m in pipe.components.items() if isinstance(m, nn.Module)}


@dataclass(frozen=True)
class ComponentPlan:
    """One component's share of the budget: its placement, calls per generation and tokens per call."""

    name: str
    placement: Placement
    calls: int
    tokens: int

    @property
    def generation_ms(self) -> float:
        """Predicted ms this component spends in one generation: its first call, then each call after
        it (which starts with its first groups copied by the call before, `Prediction.calls_ms`)."""
        return self.placement.prediction.calls_ms(self.calls)


def front(cost: ModelCost, tokens: int, profile: MachineProfile, strategy: str,
          compress: bool | str = False, calls: int = 1) -> list[Placement]:
    """The Pareto front of a component's placements: sorted by GPU bytes, each faster than every
    smaller one (predicted ms of `calls` calls one after another, at least one). compress: False
    considers raw groups only; "auto" each candidate raw and compressed (every landing-buffer option)
    where its groups shrink (`cost.tensor_wire`, else raw only); True the compressed form of every
    candidate whose groups shrink, and the raw form of the others only."""
    n = len(cost.block_bytes)
    max_part = max((len(t) for t in cost.tensor_bytes), default=0)
    coded = bool(cost.tensor_wire) and compress is not False
    points = []
    for s, u, k, part in _candidates(n, strategy, 2, max_part):
        forms = [placement_of(cost, s, k, u, part, tokens, profile, strategy=strategy, compressed=True,
                              landing_buffers=b)
                 for b in landing_options(k, len(s))] if coded and s else []
        forms = [p for p in forms if p is not None]
        if not forms or compress is not True:
            forms.append(placement_of(cost, s, k, u, part, tokens, profile, strategy=strategy))
        points += forms
    calls = max(calls, 1)
    points.sort(key=lambda p: (p.gpu_bytes, p.prediction.calls_ms(calls)))
    kept: list[Placement] = []
    for p in points:
        if not kept or p.prediction.calls_ms(calls) < kept[-1].prediction.calls_ms(calls):
            kept.append(p)
    return kept


def split_budget(costs: dict[str, ModelCost], budget: int, calls: dict[str, int], tokens: dict[str, int],
                 profile: MachineProfile, strategy: str = "auto",
                 compress: bool | str = False) -> dict[str, ComponentPlan]:
    """One placement per component, together within `budget` bytes, minimizing the predicted time of a
    generation: sum over components of their calls' predicted ms (`Prediction.calls_ms`). compress: as
    for `front` (a component streams compressed only where its cost has wire sizes). Pure logic.
    Raises BudgetError with the least budget that fits when none does."""
    fronts = {name: front(cost, tokens[name], profile, strategy, compress, calls[name])
              for name, cost in costs.items()}
    minimum = sum(f[0].gpu_bytes for f in fronts.values())
    if minimum > budget:
        hint = ""
        if compress is True:  # the landing buffers of every component that shrinks
            raw = sum(front(cost, tokens[name], profile, strategy, "auto")[0].gpu_bytes
                      for name, cost in costs.items())
            hint = (f"; compress=True streams every component whose groups shrink compressed, and their "
                    f"landing buffers need room: compress='auto' fits in {format_size(raw)}" if raw < minimum
                    else "")
        raise BudgetError(
            f"gpu_memory={format_size(budget)} cannot hold what the pipeline's models must keep on the GPU "
            f"({', '.join(f'{n} {format_size(f[0].gpu_bytes)}' for n, f in fronts.items())}): give at least "
            f"{format_size(minimum)} ({minimum} bytes){hint}", minimum)
    chosen = _merge([[(p.gpu_bytes, p.prediction.calls_ms(calls[name])) for p in f]
                     for name, f in fronts.items()], budget)
    return {name: ComponentPlan(name, f[i], calls[name], tokens[name])
            for (name, f), i in zip(fronts.items(), chosen, strict=True)}


def _merge(fronts: list[list[tuple[int, float]]], budget: int) -> list[int]:
    """The point of each front, given as (bytes, ms) pairs, whose sums have the least ms within `budget`
    bytes (ties: the fewest bytes, then the first in enumeration order). Exact: each front is added to
    every combination of the ones before it, and the result pruned to its Pareto front (more bytes only
    where faster) before the next; done in tensors, since a diffusion pipeline's fronts reach millions
    of pairs. Assumes some combination fits."""
    total_b = torch.zeros(1, dtype=torch.int64)
    total_ms = torch.zeros(1, dtype=torch.float64)
    trail = []  # per front: for each kept combination, (the combination before it, its point here)
    for points in fronts:
        pb = torch.tensor([b for b, _ in points], dtype=torch.int64)
        pm = torch.tensor([ms for _, ms in points], dtype=torch.float64)
        b = (total_b[:, None] + pb[None, :]).reshape(-1)
        ms = (total_ms[:, None] + pm[None, :]).reshape(-1)
        flat = (b <= budget).nonzero().squeeze(1)
        b, ms = b[flat], ms[flat]
        order = torch.argsort(ms, stable=True)  # then by bytes, stably: (bytes, ms, enumeration) order
        order = order[torch.argsort(b[order], stable=True)]
        b, ms, flat = b[order], ms[order], flat[order]
        best_before = torch.cat([torch.full((1,), math.inf, dtype=torch.float64), ms.cummin(0).values[:-1]])
        kept = ms < best_before  # the front: faster than every combination with fewer bytes
        total_b, total_ms, flat = b[kept], ms[kept], flat[kept]
        trail.append((flat // len(points), flat % len(points)))
    i = len(total_ms) - 1  # the front's ms fall strictly: the last is the fastest
    chosen = []
    for before, point in reversed(trail):
        chosen.append(int(point[i]))
        i = int(before[i])
    return chosen[::-1]


@dataclass(frozen=True)
class PipelineStats:
    """Per-component `OffloadStats` and the totals. Sizes in bytes; predicted_ms: one generation."""

    components: dict[str, OffloadStats]
    calls: dict[str, int]
    gpu_bytes: int
    budget_bytes: int
    predicted_ms: float

    def __str__(self) -> str:
        lines = [f"pipeline: {format_size(self.gpu_bytes)} of weights on the GPU of a "
                 f"{format_size(self.budget_bytes)} budget; predicted {self.predicted_ms:.4g} ms per "
                 "generation"]
        lines += [f"  {name} (x{self.calls[name]} per generation): {s}"
                  for name, s in self.components.items()]
        return "\n".join(lines)


class PipelineHandle:
    """The state of an offloaded pipeline. `handles` and `placements` map each nn.Module component's
    name to its `OffloadHandle` and `Placement`; `plans` to its `ComponentPlan`; `restore()` undoes
    every component's offload."""

    def __init__(self, pipe, plans: dict[str, ComponentPlan], handles: dict[str, OffloadHandle],
                 budget: int) -> None:
        self.pipe = pipe
        self.plans = plans
        self.handles = handles
        self.placements = {name: p.placement for name, p in plans.items()}
        self.budget_bytes = budget
        self.restored = False
        setattr(pipe, _PIPE_ATTR, self)
        for name in _REFUSED_AFTER_OFFLOAD:  # diffusers' own offloading would move the streamed weights
            if hasattr(pipe, name):
                object.__setattr__(pipe, name, _refused_after_offload(name))

    def _detach(self) -> None:
        """The pipeline is no longer offloaded: its own methods back, the handle's mark gone."""
        for name in _REFUSED_AFTER_OFFLOAD:
            self.pipe.__dict__.pop(name, None)
        if getattr(self.pipe, _PIPE_ATTR, None) is self:
            delattr(self.pipe, _PIPE_ATTR)
        self.restored = True

    @property
    def stats(self) -> PipelineStats:
        """Each component's stats, the GPU bytes of all of them and the predicted ms per generation."""
        return PipelineStats({n: h.stats for n, h in self.handles.items()},
                             {n: p.calls for n, p in self.plans.items()},
                             sum(p.placement.gpu_bytes for p in self.plans.values()), self.budget_bytes,
                             sum(p.generation_ms for p in self.plans.values()))

    @contextlib.contextmanager
    def edit(self):
        """Edit the pipeline's weights (`with handle.edit(): pipe.fuse_lora()`): every component is
        restored to the CPU inside the block and offloaded again on leaving it (`OffloadHandle.edit`).
        Yields the pipeline. An error in the block, or in offloading a component again (a budget the
        edited weights outgrow), leaves the whole pipeline restored on the CPU and this handle restored,
        and is raised: offload the pipeline again."""
        if self.restored:
            raise OffloadStateError("this pipeline handle was restored: offload the pipeline again to "
                                    "edit it")
        for handle in self.handles.values():  # what each component's edit() refuses, before any starts
            handle.check_editable()
        try:
            with contextlib.ExitStack() as stack:
                for handle in self.handles.values():
                    stack.enter_context(handle.edit())
                yield self.pipe
        except BaseException:  # an error in the block, or offloading a component again: none stays half
            for handle in self.handles.values():
                if not handle.restored:
                    handle.restore("cpu")
            self._detach()
            raise

    def restore(self, device: str | torch.device | None = None):
        """Restore every component (see `OffloadHandle.restore`); returns the pipeline."""
        if self.restored:
            raise OffloadStateError("this pipeline handle was already restored")
        for handle in self.handles.values():
            handle.restore(device)
        self._detach()
        return self.pipe


def _resolve_calls(modules: dict[str, nn.Module], steps: int, calls: dict[str, int] | None,
                   tokens: dict[str, int] | None):
    """Calls per generation and tokens per call of each component: the given ones, else the denoiser
    `steps` calls of `denoiser_tokens` and every other component one call of DEFAULT_TOKENS["other"]."""
    calls, tokens = dict(calls or {}), dict(tokens or {})
    for name, module in modules.items():
        denoiser = name in DENOISERS
        calls.setdefault(name, steps if denoiser else 1)
        tokens.setdefault(name, denoiser_tokens(module) if denoiser else DEFAULT_TOKENS["other"])
        if calls[name] < 0 or tokens[name] < 1:
            raise ValueError(f"{name}: calls={calls[name]}, tokens={tokens[name]}: give calls >= 0 and "
                             "tokens >= 1 per component")
    return calls, tokens


def component_costs(modules: dict[str, nn.Module], device, allow_meta: bool = False,
                    compress: bool | str = False) -> dict[str, ModelCost]:
    """Each component's cost model view, without planning (a zero placement skips the planner); with
    each tensor's predicted wire size unless `compress` is False ("auto" is False on the CPU backend,
    as for `prepare`). `offload_pipeline` then offloads each component with its placement, which
    predicts no wire sizes again."""
    empty = Placement((), 0, 0, 0, 0)
    costs = {}
    for name, m in modules.items():
        try:
            prep = prepare(m, 0, device, allow_meta=allow_meta, placement=empty, compress=compress,
                           predict_wire=True)
            costs[name] = prep.cost
        except OffloadStateError as exc:  # say which component (already offloaded on its own, on meta...)
            raise OffloadStateError(f"pipe.{name}: {exc}") from exc
    return costs


def refuse_per_model_options(config: OffloadConfig, why: str = "a pipeline is planned per component") -> None:
    """ArgumentError for what `config` holds that a pipeline's split cannot apply: blocks, tokens,
    placement and keep_resident name one model's (`offload_pipeline(tokens=..., calls=...)` takes
    tokens per component), and the split plans no expert copies and no GPU expert cache, so
    `expert_copies=True` and a `routing_skew` would be dropped. `why`: the message's reason, in the
    caller's words."""
    given = [name for name, value, unset in (
        ("tokens", config.tokens, 1), ("blocks", config.blocks, None), ("placement", config.placement, None),
        ("keep_resident", config.keep_resident, ()), ("expert_copies", config.expert_copies, False),
        ("routing_skew", config.routing_skew, None)) if value != unset]
    if given:
        raise ArgumentError(
            f"{', '.join(given)}: {why}; tokens per component go to offload_pipeline(pipe, ..., "
            "tokens={name: n}), and it plans no expert copies or GPU expert cache: drop them, or offload "
            "the one component that needs them (pipe.transformer) on its own")


def offload_pipeline(
    pipe,
    gpu_memory: int | str | OffloadConfig = "auto",
    *,
    device: str | torch.device | None = None,
    pin_memory: bool = True,
    strategy: str = "auto",
    steps: int = DEFAULT_STEPS,
    calls: dict[str, int] | None = None,
    tokens: dict[str, int] | None = None,
    compress: bool | str = "auto",
    profile: MachineProfile | None = None,
    check: bool | None = None,
) -> PipelineHandle:
    """Offload every nn.Module component of a diffusers pipeline in place under one `gpu_memory` budget
    (bytes or "12GiB": resident weights plus staging slots of all components together); return the
    `PipelineHandle`. `ws.offload(pipe, ...)` hands pipelines here.

    steps: denoising steps per generation to plan for (the denoiser, `transformer` or `unet`, runs once
        per step; every other component once). calls: calls per generation by component name, to
        override that. tokens: tokens per forward by component name (default: for the denoiser, what
        it sees at its pipeline's default generation, `DENOISER_TOKENS`: 4608 for Flux at 1024x1024,
        4096 + 333 for SD3, 32760 for Wan 2.1 at 480p and 81 frames, else 4096; 512 for the rest).
        strategy, pin_memory, device: as for `offload`.
    compress: as for `offload`, planned with the rest: "auto" (the default) streams a component's groups
        compressed where that predicts a faster generation (never on the CPU backend), True wherever
        they shrink, False never. Landing buffers count in `gpu_memory`.
    profile: the machine profile every component is planned with (default: this GPU's, as for
        `offload`); pass one and the split depends on the arguments alone.
    check: as for `offload`, for every component.
    `gpu_memory` may be an `OffloadConfig` holding device, pin_memory, strategy, compress, profile and
    check (its blocks, tokens, placement, keep_resident, expert_copies and routing_skew must stay unset:
    `refuse_per_model_options`).
    """
    config = config_of(gpu_memory, device=device, pin_memory=pin_memory, strategy=strategy,
                       compress=compress, profile=profile, check=check)
    refuse_per_model_options(config)
    device, strategy, compress, profile = config.device, config.strategy, config.compress, config.profile
    if getattr(pipe, _PIPE_ATTR, None) is not None:
        raise OffloadStateError("this pipeline is already offloaded: call handle.restore() before offloading "
                                "again")
    budget = config.gpu_memory
    modules = modules_of(pipe)
    if not modules:
        raise OffloadStateError(f"{type(pipe).__name__} has no nn.Module components to offload")
    for name, m in modules.items():
        if m.training:
            raise OffloadStateError(f"pipe.{name} is in training mode: call pipe.{name}.eval() "
                                    "(from_pretrained pipelines are in eval mode already)")
        m.requires_grad_(False)  # a pipeline runs under no_grad: gradients are never used
    calls, tokens = _resolve_calls(modules, steps, calls, tokens)
    costs = component_costs(modules, device, compress=compress)
    if profile is None:
        profile = load_profile(device)
    plans = split_budget(costs, budget, calls, tokens, profile, strategy, compress)
    handles: dict[str, OffloadHandle] = {}
    try:
        for name, m in modules.items():
            p = plans[name].placement
            handles[name] = offload_module(m, config.replace(gpu_memory=p.gpu_bytes, placement=p,
                                                             compress=p.compressed))
    except BaseException:
        for h in handles.values():
            h.restore()
        raise
    return PipelineHandle(pipe, plans, handles, budget)


def host_shares(needs: dict[str, tuple[int, list[int]]], calls: dict[str, int],
                cpu_memory: int | None) -> dict[str, int | None]:
    """Each component's host memory, in bytes, out of `cpu_memory` for a pipeline loaded into place.
    needs[name] = (its zero-copy bytes, each of its streamed groups' bytes). Every component first gets
    what it cannot do without: its zero-copy bytes, plus all its groups or, when those are more, the
    disk tier's two bounce buffers of its largest group (`placement.plan.choose_disk_groups`: each group
    beyond its share stays on disk). The rest goes to the components called most per generation first
    (a group kept on disk is read once per call), each up to all its groups in host memory. Pure logic.
    None (no limit) gives every component None. Raises BudgetError with the least cpu_memory that fits."""
    if cpu_memory is None:
        return dict.fromkeys(needs)
    full = {name: uva + sum(groups) for name, (uva, groups) in needs.items()}
    least = {name: uva + min(sum(groups), 2 * max(groups, default=0))
             for name, (uva, groups) in needs.items()}
    minimum = sum(least.values())
    if minimum > cpu_memory:
        each = ", ".join(f"{n} {format_size(b)}" for n, b in least.items())
        raise BudgetError(
            f"cpu_memory={format_size(cpu_memory)} cannot hold what the pipeline's models need in host "
            f"memory even with their streamed groups on disk ({each}: zero-copy blocks, and two bounce "
            f"buffers of the largest group each): give at least {format_size(minimum)} ({minimum} bytes), "
            "or a larger gpu_memory", minimum)
    shares = dict(least)
    left = cpu_memory - minimum
    for name in sorted(needs, key=lambda n: -calls[n]):  # stable: model_index.json's order among equals
        more = min(left, full[name] - shares[name])
        shares[name] += more
        left -= more
    return shares


def load_pipeline(path, config: OffloadConfig, *, cpu_memory: int | str | None = None,
                  dtype: torch.dtype | str | None = None, progress: bool = True, cache_dir=None,
                  steps: int = DEFAULT_STEPS, build_context, load) -> PipelineHandle:
    """`weightstream.from_pretrained` for a local diffusers pipeline folder (`model_index.json` and a
    subfolder per component): every nn.Module component built with its parameters on the meta device
    (`meta_components` in `build_context`), planned under one budget (`split_budget`, as
    `offload_pipeline` plans; `config.gpu_memory` for all of them), then each tensor read from its
    safetensors straight into its final place (`load`, one component at a time); the pipeline object,
    tokenizers and scheduler come from `DiffusionPipeline.from_pretrained` given those components. The
    whole model is never in host memory: its streamed groups take at most `cpu_memory` bytes ("16GiB";
    None: no limit), shared by `host_shares`, and groups beyond a component's share stay in its files
    (the disk tier). steps: denoising steps per generation to plan for, as `offload_pipeline`'s (the
    budget split and the host shares weigh each component by its calls per generation). dtype: every
    component's (default: each in the dtype its weights are stored in,
    with what its library keeps in float32 in float32, as diffusers loads it with that dtype).
    build_context and load are formats/hf.py's `params_on_meta` and `load_into_place`, passed by its
    `from_pretrained` (which calls this), so this module does not import the checkpoint reader back.
    Returns the `PipelineHandle` (`handle.pipe` is the pipeline); nothing stays allocated on an error."""
    try:
        import diffusers
    except ImportError:
        raise CheckpointError(f"{path} is a diffusers pipeline folder: loading it needs diffusers (pip "
                              "install diffusers)") from None
    refuse_per_model_options(config)
    folder = Path(path)
    host_bytes = None if cpu_memory is None else parse_size(cpu_memory)
    modules = meta_components(str(folder), dtype, build_context)
    if not modules:
        raise CheckpointError(f"{folder / 'model_index.json'} names no model to offload: load the pipeline "
                              "with diffusers.DiffusionPipeline.from_pretrained")
    calls, tokens = _resolve_calls(modules, steps, None, None)
    costs = component_costs(modules, config.device, allow_meta=True, compress=config.compress)
    profile = load_profile(config.device) if config.profile is None else config.profile
    plans = split_budget(costs, config.gpu_memory, calls, tokens, profile, config.strategy, config.compress)
    configs = _component_configs(plans, config)
    _, _, shares = _component_shares(modules, configs, calls, host_bytes)
    # the rest as diffusers loads it; the pipeline's own class, since DiffusionPipeline's would load the
    # components its class marks optional (WanPipeline's transformer) from the files instead
    from .formats.checkpoint import read_json

    pipeline_class = getattr(diffusers, str(read_json(folder / "model_index.json").get("_class_name")),
                             diffusers.DiffusionPipeline)
    pipe = pipeline_class.from_pretrained(folder, **modules)
    loaded_again = [name for name, m in modules.items() if pipe.components.get(name) is not m]
    if loaded_again:  # never a second copy of a model in host memory
        raise CheckpointError(f"{pipeline_class.__name__}.from_pretrained did not take the built "
                              f"{', '.join(loaded_again)}: load this pipeline with diffusers and call "
                              "weightstream.offload on it")
    handles: dict[str, OffloadHandle] = {}
    try:
        for name in tqdm(modules, desc="loading pipeline", unit="model", disable=not progress):
            handles[name] = load(modules[name], folder / name, configs[name], shares[name], cache_dir,
                                 progress)
    except BaseException:
        for h in handles.values():
            h.restore()
        raise
    return PipelineHandle(pipe, plans, handles, config.gpu_memory)


# dtypes a module can be built in (torch's default dtype): the ones a stored checkpoint is counted in
_BUILD_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def stored_dtype(folder: str) -> torch.dtype:
    """The dtype a model folder's weights are stored in: the floating-point dtype holding most bytes of
    its safetensors files (read from their headers; variant files such as `*.fp16.safetensors` only
    when the folder has no others), else the `torch_dtype` (or `dtype`) its config.json names, else
    bfloat16 (a folder of configs only)."""
    import re
    from pathlib import Path

    from .dtypes import parse_dtype
    from .formats.checkpoint import _read_header, read_json

    files = sorted(Path(folder).glob("*.safetensors"))
    # model.safetensors, model-00001-of-00002.safetensors; a variant has a dot in its stem: model.fp16...
    plain = [f for f in files if "." not in re.sub(r"-\d+-of-\d+$", "", f.stem)]
    stored: dict[torch.dtype, int] = {}
    for f in plain or files:
        for t in _read_header(f).values():
            if t.dtype in _BUILD_DTYPES:
                stored[t.dtype] = stored.get(t.dtype, 0) + t.nbytes
    if stored:
        return max(stored, key=stored.get)
    config = Path(folder) / "config.json"
    fields = read_json(config) if config.is_file() else {}
    named = fields.get("torch_dtype") or fields.get("dtype")  # transformers' name, then its newer one
    try:
        return parse_dtype(named) if named else torch.bfloat16
    except ArgumentError:  # "auto" or a dtype a module cannot be built in
        return torch.bfloat16


def meta_diffusers_model(folder: str, class_name: str, dtype: torch.dtype | str | None = None) -> nn.Module:
    """A diffusers model (`class_name`, e.g. FluxTransformer2DModel) from the config.json in `folder`,
    built in `dtype` (default: the dtype its weights are stored in, `stored_dtype`) on the meta device:
    sizes only, no weights read."""
    import diffusers

    from .dtypes import parse_dtype

    cls = getattr(diffusers, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ArgumentError(f"{folder}/config.json names _class_name {class_name!r}, which diffusers "
                            f"{diffusers.__version__} does not have")
    dtype = stored_dtype(folder) if dtype is None else parse_dtype(dtype)
    with torch.device("meta"):
        return _build_component(cls, "diffusers", Path(folder), dtype)


def is_pipeline_folder(path) -> bool:
    """True when `path` is a local folder holding a diffusers pipeline's `model_index.json`."""
    try:
        return (Path(path) / "model_index.json").is_file()
    except (TypeError, ValueError, OSError):  # not a path at all
        return False


def _component_class(folder: Path, name: str, library: str, class_name: str) -> type | None:
    """The class `model_index.json` names for component `name`, when it is an nn.Module (None for a
    tokenizer, scheduler or processor: diffusers loads those). `library` is a package (diffusers,
    transformers) or a diffusers pipeline module (`stable_diffusion`), as diffusers resolves it."""
    import importlib

    module = None
    for candidate in (library, f"diffusers.pipelines.{library}"):
        try:
            module = importlib.import_module(candidate)
            break
        except ImportError:
            continue
    cls = getattr(module, class_name, None) if module is not None else None
    if cls is None:
        version = getattr(module, "__version__", None) or getattr(importlib.import_module("diffusers"),
                                                                  "__version__", "")
        raise CheckpointError(
            f"{folder / 'model_index.json'} names the component {name} as {library}.{class_name}, which "
            f"{'cannot be imported' if module is None else f'this {library} ({version}) does not have'}: "
            f"install or upgrade {library.split('.')[0]} to one that has it, or re-save the pipeline")
    return cls if isinstance(cls, type) and issubclass(cls, nn.Module) else None


def _build_component(cls: type, library: str, folder: Path, dtype: torch.dtype) -> nn.Module:
    """`cls` built from the config.json in `folder` in `dtype` (under whatever device context the caller
    holds), in eval mode without gradients, with the tensors its library keeps in float32 at that dtype
    in float32 (`_keep_in_fp32`). Raises CheckpointError when the library cannot build it."""
    try:
        with default_dtype(dtype):
            if library == "transformers":
                from transformers import AutoConfig

                model = cls(AutoConfig.from_pretrained(folder, local_files_only=True))
            else:
                model = cls.from_config(cls.load_config(folder))
    except (ValueError, TypeError, KeyError, AttributeError, OSError) as err:
        first = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise CheckpointError(f"{folder}: {library} cannot build {cls.__name__} from its config.json "
                              f"({first}): re-save the pipeline, or use the {library} version that wrote "
                              "it") from None
    _keep_in_fp32(model, library, dtype)
    return model.eval().requires_grad_(False)


def _keep_in_fp32(model: nn.Module, library: str, dtype: torch.dtype) -> None:
    """Make float32 the floating-point tensors that `model`'s library keeps in float32 when it loads
    the model in `dtype`, so a model built here has the dtypes `DiffusionPipeline.from_pretrained(folder,
    dtype=dtype)` gives it: diffusers keeps a tensor whose name has a part named in the class's
    `_keep_in_fp32_modules` (at any dtype); transformers a tensor whose name matches a pattern of the
    model's `_get_dtype_plan(dtype)` (`_keep_in_fp32_modules` at fp16, `_keep_in_fp32_modules_strict`
    at fp16 and bf16)."""
    import re

    if dtype == torch.float32:
        return
    if library == "transformers":
        plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
        patterns = [re.compile(p.replace("*", ".*")) for p in plan]

        def keep(name: str) -> bool:
            return any(p.search(name) for p in patterns)
    else:
        parts = list(getattr(model, "_keep_in_fp32_modules", None) or [])

        def keep(name: str) -> bool:
            return any(part in name.split(".") for part in parts)

    # by the tensor it replaces (kept alive, so no other tensor takes its id): tied tensors stay one
    upcast: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for prefix, module in model.named_modules():
        for tensors in (module._parameters, module._buffers):
            for name, t in tensors.items():
                if t is None or not t.is_floating_point() or t.dtype == torch.float32:
                    continue
                if id(t) in upcast or keep(f"{prefix}.{name}" if prefix else name):
                    if id(t) not in upcast:
                        fp32 = t.detach().to(torch.float32)
                        upcast[id(t)] = (t, nn.Parameter(fp32, requires_grad=False) if isinstance(
                            t, nn.Parameter) else fp32)
                    tensors[name] = upcast[id(t)][1]


def meta_components(folder: str, dtype: torch.dtype | str | None = None,
                    build_context=None) -> dict[str, nn.Module]:
    """The nn.Module components of a local diffusers pipeline folder (`model_index.json` and one
    subfolder with a config.json per component), built on the meta device: sizes, no memory, no weights
    read. Each is built in `dtype`, by default the dtype its own subfolder's weights are stored in
    (`stored_dtype`: an fp32 pipeline is planned at fp32 sizes), with what its library keeps in float32
    at that dtype in float32. Tokenizers and schedulers are left out. build_context: a function giving
    the context manager each is built in (default: the meta device for every tensor; `from_pretrained`
    gives one that keeps buffers real). Raises CheckpointError naming a component whose folder or class
    is missing or that its library cannot build."""
    from .dtypes import parse_dtype
    from .formats.checkpoint import read_json

    folder = Path(folder)
    index = read_json(folder / "model_index.json")
    modules: dict[str, nn.Module] = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or None in entry:
            continue
        library, class_name = entry
        cls = _component_class(folder, name, library, class_name)
        if cls is None:  # a tokenizer, scheduler or processor
            continue
        sub = folder / name
        if not (sub / "config.json").is_file():
            raise CheckpointError(
                f"{folder / 'model_index.json'} names the component {name} ({class_name}), but "
                f"{sub / 'config.json'} is missing: copy the whole folder save_pretrained wrote, or re-save "
                "the pipeline")
        built_in = stored_dtype(str(sub)) if dtype is None else parse_dtype(dtype)
        with build_context() if build_context is not None else torch.device("meta"):
            kind = "transformers" if library == "transformers" else "diffusers"  # diffusers builds the rest
            modules[name] = _build_component(cls, kind, sub, built_in)
    return modules


def plan_pipeline(folder: str, gpu_memory: int | str | OffloadConfig, steps: int = DEFAULT_STEPS,
                  strategy: str = "auto", profile: MachineProfile | None = None,
                  compress: bool | str = "auto", dtype: torch.dtype | str | None = None,
                  cpu_memory: int | str | None = None) -> dict:
    """`weightstream plan` for a pipeline folder: each component's placement under one `gpu_memory`
    budget (as `offload(pipe, ...)` would split it), its calls per generation, predicted ms and bytes on
    the wire; plain data. Components are built on the meta device from their configs (no weights read)
    in `dtype`, by default each in the dtype its weights are stored in (`stored_dtype`; bfloat16 for a
    folder of configs only), so compressed sizes are predicted for Hugging Face-initialized weights.
    compress: as for `offload_pipeline` ("auto" plans raw groups on a machine without CUDA).
    cpu_memory: host memory for all streamed groups, bytes or "16GiB", as for `from_pretrained(folder)`
    (None: no limit): each component's `host_bytes` is its share (`host_shares`, as the load shares it;
    with no limit, all its zero-copy and streamed bytes) and `disk_bytes` the tensor bytes of its groups
    that stay in their files (`choose_disk_groups`, as the load chooses them; `OffloadStats.disk_bytes`
    after a load at the default steps). Raises BudgetError, as the load does, when it is too small."""
    auto_raw = compress == "auto" and not isinstance(gpu_memory, OffloadConfig)  # raw without CUDA?
    config = config_of(gpu_memory, strategy=strategy, compress=compress, profile=profile)
    refuse_per_model_options(config)
    auto_raw = auto_raw and not config.compress
    strategy, compress, budget = config.strategy, config.compress, config.gpu_memory
    modules = meta_components(folder, dtype)
    calls, tokens = _resolve_calls(modules, steps, None, None)
    profile = load_profile(config.device) if config.profile is None else config.profile
    # wire sizes whenever compression is considered (built on the meta device, so "auto" would mean raw)
    costs = component_costs(modules, "cpu", allow_meta=True, compress=compress is not False)
    plans = split_budget(costs, budget, calls, tokens, profile, strategy, compress)
    host = _host_tier(modules, plans, config, calls, None if cpu_memory is None else parse_size(cpu_memory))
    rows = {}
    for name, p in plans.items():
        pl = p.placement
        wire, raw = wire_of(costs[name], pl)
        dtype_name = str(next(modules[name].parameters(), torch.empty(0)).dtype).removeprefix("torch.")
        rows[name] = {"class": type(modules[name]).__name__, "dtype": dtype_name, "calls": p.calls,
                      "tokens": p.tokens,
                      "weight_bytes": pl.resident_bytes + pl.offloaded_bytes, "gpu_bytes": pl.gpu_bytes,
                      "resident_bytes": pl.resident_bytes, "streamed_blocks": len(pl.streamed),
                      "zero_copy_blocks": len(pl.uva), "slots": pl.n_slots, "slot_bytes": pl.slot_bytes,
                      "placement_kind": pl.kind, "compressed": pl.compressed, "wire_bytes": wire,
                      "wire_raw_bytes": raw, "landing_buffers": pl.n_landing,
                      "landing_bytes": pl.landing_bytes,
                      "ms_first_call": round(pl.prediction.ms, 2),
                      "ms_per_call": round(pl.prediction.again_ms, 2),
                      "ms_per_generation": round(p.generation_ms, 1), **host[name]}
    return {"pipeline": folder, "budget_bytes": budget, "steps": steps, "compress": compress,
            "compress_auto_raw_without_cuda": auto_raw,
            "cpu_memory_bytes": None if cpu_memory is None else parse_size(cpu_memory),
            "host_bytes": sum(r["host_bytes"] for r in rows.values()),
            "disk_bytes": sum(r["disk_bytes"] for r in rows.values()),
            "profile": {"gpu": profile.gpu, "h2d_GBps": round(profile.h2d_GBps, 1)},
            "gpu_bytes": sum(r["gpu_bytes"] for r in rows.values()),
            "predicted_ms_per_generation": round(sum(p.generation_ms for p in plans.values()), 1),
            "components": rows}


def _component_configs(plans: dict[str, ComponentPlan], config: OffloadConfig) -> dict[str, OffloadConfig]:
    """Each component's config: `config` with its share of the budget and its planned placement."""
    return {name: config.replace(gpu_memory=p.placement.gpu_bytes, placement=p.placement,
                                 compress=p.placement.compressed) for name, p in plans.items()}


def _component_shares(modules: dict[str, nn.Module], configs: dict[str, OffloadConfig], calls: dict[str, int],
                      cpu_memory: int | None):
    """Each component prepared under its config (moves nothing), what it needs in host memory (its
    zero-copy bytes, each streamed group's bytes) and its share of `cpu_memory` (`host_shares`), as
    (preps, needs, shares): what `load_pipeline` loads with and `plan_pipeline` reports."""
    preps = {name: prepare(m, configs[name], allow_meta=True, predict_wire=False)
             for name, m in modules.items()}
    needs = {name: (sum(prep.uva_group_bytes), prep.group_bytes) for name, prep in preps.items()}
    return preps, needs, host_shares(needs, calls, cpu_memory)


def _host_tier(modules: dict[str, nn.Module], plans: dict[str, ComponentPlan], config: OffloadConfig,
               calls: dict[str, int], cpu_memory: int | None) -> dict[str, dict[str, int]]:
    """Where each component's offloaded bytes live when its pipeline folder is loaded with `cpu_memory`
    bytes of host memory for them (None: no limit), decided as `load_pipeline` and `load_into_place`
    decide it: `host_bytes` (its share, `host_shares`), `disk_bytes` and `disk_groups` (the tensor bytes
    and count of its streamed groups left in their files, `choose_disk_groups`). Moves nothing; a
    group's byte layout is the same on every device, so the groups are laid out for the CPU."""
    configs = _component_configs(plans, config.replace(device="cpu"))
    preps, needs, shares = _component_shares(modules, configs, calls, cpu_memory)
    tiers = {}
    for name, prep in preps.items():
        uva, groups = needs[name]
        share = shares[name]
        on_disk = choose_disk_groups(groups, None if share is None else share - uva)
        tiers[name] = {"host_bytes": uva + sum(groups) if share is None else share,
                       "disk_bytes": sum(entry.nbytes for g in on_disk for entry, _ in prep.groups[g]),
                       "disk_groups": len(on_disk)}
    return tiers


def format_pipeline_plan(r: dict) -> str:
    """A readable table of `plan_pipeline`'s result: per component its placement, the host memory it gets
    and the bytes left on disk (under a `cpu_memory` limit) and, for what streams, the bytes one call
    moves over the link ("wire": compressed blobs, or the raw groups) and the ratio."""
    lines = [f"{r['pipeline']}: budget {format_size(r['budget_bytes'])} for all components, {r['steps']} "
             f"steps, on {r['profile']['gpu']} ({r['profile']['h2d_GBps']} GB/s host->GPU)",
             f"{'component':16}{'calls':>6}{'weights':>12}{'on GPU':>12}{'host':>12}{'on disk':>12}"
             f"{'streamed':>9}{'zero copy':>10}{'wire/call':>12}{'ratio':>7}{'ms/call':>10}{'ms/gen':>10}"
             "  strategy"]
    for name, c in r["components"].items():
        ratio = c["wire_bytes"] / c["wire_raw_bytes"] if c["wire_raw_bytes"] else 1.0
        kind = c["placement_kind"] + (f", compressed (landing buffers {c['landing_buffers']} x "
                                      f"{format_size(c['landing_bytes'])})" if c["compressed"] else "")
        lines.append(f"{name:16}{c['calls']:>6}{format_size(c['weight_bytes']):>12}"
                     f"{format_size(c['gpu_bytes']):>12}{format_size(c['host_bytes']):>12}"
                     f"{format_size(c['disk_bytes']):>12}{c['streamed_blocks']:>9}{c['zero_copy_blocks']:>10}"
                     f"{format_size(c['wire_bytes']):>12}{ratio:>7.3f}{c['ms_per_call']:>10.1f}"
                     f"{c['ms_per_generation']:>10.1f}  {kind}")
    lines.append(f"GPU memory for weights: {format_size(r['gpu_bytes'])} (landing buffers included); "
                 f"predicted {r['predicted_ms_per_generation']:.0f} ms per generation (denoiser steps plus "
                 "one call of each other component; the VAE's convolutions are costed as GEMMs, a rough "
                 "guess)")
    if r["cpu_memory_bytes"] is None:
        lines.append(f"host memory for offloaded weights: {format_size(r['host_bytes'])} (no cpu_memory "
                     "limit: nothing on disk)")
    else:
        lines.append(f"host memory for offloaded weights: at most {format_size(r['host_bytes'])} of "
                     f"cpu_memory {format_size(r['cpu_memory_bytes'])} (the components called most per "
                     f"generation first); {format_size(r['disk_bytes'])} stay on disk, read every call "
                     "through two pinned bounce buffers of their component's largest group (counted in its "
                     "host memory)")
    streams = any(c["streamed_blocks"] for c in r["components"].values())
    if r.get("compress_auto_raw_without_cuda") and streams:
        lines.append(AUTO_RAW_NOTE)
    if r["compress"] is not False:
        lines.append("compressed sizes are predicted for Hugging Face-initialized weights; real ones differ")
    return "\n".join(lines)
