"""`from_pretrained`: load a local Hugging Face checkpoint straight into its offloaded places.

The model is built with its parameters on the meta device (buffers, such as rotary tables, are
computed as usual), the placement is decided from the sizes alone, and each tensor is then read from
its shard straight into its final place: a resident one onto the device (through a bounce buffer of
the largest tensor's size), a streamed one into its pinned host region. The full model is never on
the GPU, and host memory peaks at the streamed bytes plus that one bounce buffer.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..config import OffloadConfig, config_of
from ..dtypes import parse_dtype
from ..engine import coded_experts, expert_cache
from ..engine.host import HostArena
from ..errors import ArgumentError, BudgetError, CheckpointError
from ..handle import OffloadHandle, finish
from ..pipeline import DEFAULT_STEPS, PipelineHandle, _keep_in_fp32, is_pipeline_folder, load_pipeline
from ..placement.entries import Entry, _set_tensor
from ..placement.layout import Slice
from ..placement.plan import choose_disk_groups
from ..placement.prepare import final_places, prepare
from ..placement.probe import MachineProfile
from ..sizes import format_size, parse_size
from ..wire import coded_load
from . import convert, fp8
from .checkpoint import StoredTensor, read_index, read_json
from .disk import DiskTier


@contextlib.contextmanager
def params_on_meta():
    """Build modules with their parameters on the meta device and their buffers real.

    Parameters are allocated uninitialized and moved to meta as they are registered, so their
    initializers cost nothing; buffers computed in constructors (rotary tables) stay correct.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def checkpoint_folder(path: str | os.PathLike) -> Path:
    """`path` as a local checkpoint folder; raises CheckpointError when it is not one (never looks
    anything up on a model hub)."""
    try:
        folder = Path(path)
        is_dir = folder.is_dir()
    except (TypeError, ValueError, OSError):  # not a path, an embedded NUL byte, a name too long
        raise CheckpointError(f"{path!r} is not a folder path: give the folder a save_pretrained call "
                              "wrote") from None
    if not is_dir:
        raise CheckpointError(f"{folder} is not a folder: give the folder a save_pretrained call wrote")
    if not (folder / "config.json").is_file():
        raise CheckpointError(
            f"{folder} is not a Hugging Face checkpoint folder: it has no config.json (a model's) nor "
            "model_index.json (a diffusers pipeline's): give the folder that save_pretrained wrote"
        )
    return folder


SUPPORTED = (
    "the transformers class named in config.json's `architectures` (what save_pretrained recorded: "
    "causal LMs such as LlamaForCausalLM, seq2seq models such as T5ForConditionalGeneration, encoders "
    "such as BertModel), or AutoModelForCausalLM where config.json names none"
)


def diffusers_class(folder: Path) -> str | None:
    """The `_class_name` of a diffusers model's config.json in `folder` (FluxTransformer2DModel...), or
    None for any other config."""
    return _diffusers_class_name(read_json(folder / "config.json"))


def _diffusers_class_name(fields: dict) -> str | None:
    name = fields.get("_class_name")
    return name if isinstance(name, str) and "_diffusers_version" in fields else None


def read_config(folder: Path):
    """The transformers config in `folder`/config.json; CheckpointError (naming the file and what to
    change) when it is not valid JSON, has no model_type, or transformers does not know it."""
    try:
        from transformers import AutoConfig
    except ImportError as err:
        raise CheckpointError("loading a checkpoint needs transformers: pip install 'weightstream[hf]'"
                              ) from err
    path = folder / "config.json"
    fields = read_json(path)
    cls = _diffusers_class_name(fields)
    if cls is not None:
        raise CheckpointError(
            f"{path} is a diffusers {cls} config: from_pretrained loads transformers checkpoints. Load it "
            f"with diffusers ({cls}.from_pretrained(folder, torch_dtype=torch.bfloat16), or its whole "
            "pipeline) and call weightstream.offload on it; `weightstream plan FOLDER` plans it")
    if not isinstance(fields.get("model_type"), str):
        raise CheckpointError(f"{path} has no model_type: give the config.json that save_pretrained wrote")
    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, KeyError, OSError, TypeError) as err:
        first = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise CheckpointError(f"{path}: transformers cannot read this config (model_type "
                              f"{fields['model_type']!r}; {first})") from None


def config_dtype(config, dtype: torch.dtype | str | None = None, folder: Path | None = None) -> torch.dtype:
    """The dtype a model is built in, as transformers' from_pretrained (dtype "auto", its default) picks
    it: `dtype` when given (other than "auto"), else the config's, else the first floating-point tensor
    stored in `folder`'s checkpoint, else float32."""
    if dtype is not None and not (isinstance(dtype, str) and dtype.strip().lower() == "auto"):
        return parse_dtype(dtype)
    stored = config.dtype if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    try:
        if stored is not None:
            return parse_dtype(stored)
    except (ValueError, ArgumentError):
        pass
    if folder is not None:
        try:
            tensors = read_index(folder)
        except CheckpointError:
            tensors = {}
        for tensor in tensors.values():
            if tensor.dtype.is_floating_point and tensor.dtype.itemsize >= 2:  # not an fp8 one
                return tensor.dtype
    return torch.float32


def model_class(config, folder: Path):
    """The transformers class to build: the one config.json's `architectures` names, else
    AutoModelForCausalLM. Raises CheckpointError naming what is supported."""
    import transformers

    names = getattr(config, "architectures", None) or []
    if names:
        cls = getattr(transformers, names[0], None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
        raise CheckpointError(f"{folder}/config.json names the class {names[0]!r}, which this transformers "
                              f"({transformers.__version__}) lacks: weightstream loads {SUPPORTED}")
    return transformers.AutoModelForCausalLM


def build_model(folder: Path, dtype: torch.dtype | str | None, on_meta: bool = False) -> nn.Module:
    """The model of the checkpoint in `folder`, in eval mode without gradients, with its parameters on
    the meta device (buffers real; `on_meta`: buffers on meta too, for planning only)."""
    config = read_config(folder)
    cls = model_class(config, folder)
    dtype = config_dtype(config, dtype, folder)
    build = cls.from_config if cls.__name__.startswith("Auto") else cls._from_config
    try:
        with torch.device("meta") if on_meta else params_on_meta():
            model = build(config, dtype=dtype)
    except (ValueError, KeyError, TypeError) as err:
        first = str(err).splitlines()[0][:200]
        raise CheckpointError(f"{folder}: cannot build {cls.__name__} for model_type {config.model_type!r} "
                              f"({first}); weightstream loads {SUPPORTED}") from None
    _keep_in_fp32(model, "transformers", dtype)  # T5's wo at fp16, as transformers' own load keeps them
    _quantized_layers(model, config, folder)
    _generation_config(model, folder)
    return model.eval().requires_grad_(False)


def _generation_config(model: nn.Module, folder: Path) -> None:
    """Read the folder's generation_config.json as transformers' own load does (its stop tokens, such
    as an instruct model's end of turn, and its other defaults); built from config.json alone, the
    model would generate past them."""
    can_generate = getattr(model, "can_generate", lambda: False)()
    if not can_generate or not (folder / "generation_config.json").is_file():
        return
    from transformers import GenerationConfig

    try:
        model.generation_config = GenerationConfig.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{folder}/generation_config.json cannot be read: {str(err)[:200]}") from None


def _quantized_layers(model: nn.Module, config, folder: Path) -> None:
    """Give a model built from a quantized checkpoint's config the layers its tensors load into: FP8
    (transformers' fine-grained "fp8" method) gets `fp8.Fp8Linear`; any other method is refused, so
    nothing is ever dequantized on load."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method = quant.get("quant_method")
    if method != "fp8":
        raise CheckpointError(
            f"{folder}: config.json's quantization_config has quant_method={method!r}; from_pretrained loads "
            "bf16/fp16/fp32 and fine-grained FP8 ('fp8') checkpoints. For others, build the quantized model "
            "yourself (e.g. torchao's quantize_) and call weightstream.offload on it"
        )
    try:
        fp8.convert_for_checkpoint(model, quant)
    except ValueError as err:
        raise CheckpointError(f"{folder}: {err}") from None


def _entry_names(model: nn.Module, entries: list[Entry]) -> dict[str, Entry]:
    """Every qualified name under which each entry appears (tied weights have several)."""
    paths: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(name)
    names = {}
    for entry in entries:
        for site in entry.sites:
            for path in paths[id(site.module)]:
                names[f"{path}.{site.name}" if path else site.name] = entry
    return names


def _match(model: nn.Module, entries: list[Entry], stored: dict[str, StoredTensor], folder: Path):
    """Pair every persistent entry (a parameter or a saved buffer) with its `convert.Source` (the stored
    tensors it is made of, after transformers' conversion rules for the model); check shapes and
    dtypes."""
    names = _entry_names(model, entries)
    first_name = {}
    for name, entry in names.items():
        first_name.setdefault(id(entry), name)
    persistent = {id(e) for e in entries if any(s.persistent for s in e.sites)}
    made, unexpected = convert.sources(model, stored, folder)
    pairs: dict[int, tuple[Entry, convert.Source]] = {}
    for name, source in made.items():
        entry = names.get(name)
        if entry is not None and id(entry) in persistent:
            kept = pairs.setdefault(id(entry), (entry, source))[1]
            if kept is not source and not _same_stored(kept, source):
                raise CheckpointError(
                    f"{folder}: the model built from config.json ties {kept.name} and {name} (one tensor, "
                    "e.g. tie_word_embeddings), but the checkpoint stores them with different values; "
                    "transformers then loads them untied. Set \"tie_word_embeddings\": false in config.json "
                    "to load them as stored (or save the checkpoint again with the weights tied)")
        elif entry is None:
            unexpected.append(name)
    missing = [e for e in entries if id(e) in persistent and id(e) not in pairs]
    unexpected = sorted(set(unexpected))
    if missing:
        example = first_name[id(missing[0])]
        hint = (" The checkpoint stores tensors the model does not have, even after transformers' conversion "
                f"rules for {type(model).__name__} (e.g. {unexpected[0]}): check that config.json belongs "
                "to these weights." if unexpected else "")
        recomputed = [p for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or []
                      if re.search(p, example)]
        if recomputed:
            hint = (f" {type(model).__name__} lists it in _keys_to_ignore_on_load_missing: transformers "
                    "computes it when it loads the model, which from_pretrained here does not; load the "
                    "model with transformers, then weightstream.offload(model, ...).")
        raise CheckpointError(f"{folder}: {len(missing)} tensor(s) the model needs are not in the "
                              f"checkpoint, e.g. {example}.{hint}")
    if unexpected:
        warnings.warn(f"{folder}: ignoring {len(unexpected)} checkpoint tensor(s) the model does not have, "
                      f"e.g. {unexpected[:3]}", stacklevel=3)
    for entry, source in pairs.values():
        name = first_name[id(entry)]
        if tuple(source.shape) != tuple(entry.shape):
            made_of = f" (made of {len(source.reads)} stored tensors)" if len(source.reads) > 1 else ""
            raise CheckpointError(f"{folder}: {name} has shape {list(source.shape)} in the checkpoint"
                                  f"{made_of} but {list(entry.shape)} in the model built from config.json")
        low = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8)
        if source.dtype.is_floating_point != entry.dtype.is_floating_point or (
                (source.dtype in low) != (entry.dtype in low)):  # never a silent (de)quantize
            raise CheckpointError(f"{folder}: {name} is {source.dtype} in the checkpoint but the model "
                                  f"expects {entry.dtype}")
    return list(pairs.values())


def _same_stored(a: convert.Source, b: convert.Source) -> bool:
    """Whether two sources are stored as the same bytes (a tied tensor saved under both its names)."""
    if a.converted or b.converted or a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return a.converted and b.converted  # what transformers' conversions make is not compared
    first, second = a.reads[0].stored, b.reads[0].stored
    if (first.path, first.offset) == (second.path, second.offset):
        return True
    chunk = 1 << 24
    with open(first.path, "rb") as f, open(second.path, "rb") as g:
        for start in range(0, first.nbytes, chunk):
            n = min(chunk, first.nbytes - start)
            mine = os.pread(f.fileno(), n, first.offset + start)
            if mine != os.pread(g.fileno(), n, second.offset + start):
                return False
    return True


def _fill(pairs, places: dict[int, torch.Tensor], progress: bool) -> None:
    """Read every stored tensor into its place (its region of a fused tensor), in file order,
    converting dtype where the model asks for another."""
    staging = max((r.stored.nbytes for _, source in pairs for r in source.reads), default=0)
    bounce = torch.empty(staging, dtype=torch.uint8)
    total = sum(source.nbytes for _, source in pairs)
    units = []  # (where it lies, entry, source): each placed read alone, a transformers convert whole
    for entry, source in pairs:
        parts = [source] if source.converter is not None else [
            convert.Source(source.name, [r], source.shape, source.dtype) for r in source.reads]
        units += [((str(p.reads[0].stored.path), p.reads[0].stored.offset), entry, p) for p in parts]
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading", disable=not progress) as bar:
        for _, entry, source in sorted(units, key=lambda u: u[0]):
            source.fill(places[id(entry)], bounce)
            bar.update(source.nbytes)


def from_pretrained(
    path: str | os.PathLike,
    gpu_memory: int | str | OffloadConfig = "auto",
    *,
    cpu_memory: int | str | None = None,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    pin_memory: bool = True,
    strategy: str = "auto",
    tokens: int = 1,
    progress: bool = True,
    profile: MachineProfile | None = None,
    compress: bool | str = "auto",
    cache_dir: str | os.PathLike | None = None,
    steps: int | None = None,
    expert_cache: bool = True,
    routing_skew: float | None = None,
    expert_copies: bool = False,
) -> nn.Module | PipelineHandle:
    """Load the model in the local folder `path` so its weights take at most `gpu_memory`.

    path: a folder written by `save_pretrained` (config.json and safetensors shards). Nothing is
        downloaded. The model class is the one config.json's `architectures` names (causal LMs,
        seq2seq models, encoders...), else AutoModelForCausalLM.
    cpu_memory: host memory for the streamed weights, bytes or "64GiB" (default: no limit). Streamed
        groups beyond it stay in the safetensors files and are read every forward through two pinned
        bounce buffers (counted in cpu_memory); that disk tier needs the checkpoint's dtype and cannot
        be captured in CUDA graphs. The planner keeps zero-copy blocks within it.
    dtype: the model's dtype, a torch.dtype or a name such as "bfloat16" or "fp16" (default: the
        config's, else float32).
    strategy, tokens, profile, compress, expert_cache, routing_skew, expert_copies: as for `offload`
        ("auto", "stream" or "uva"; tokens per forward to plan for; the machine profile to plan with;
        stream groups losslessly compressed; a GPU expert cache for a mixture of experts where the
        planner predicts it faster; the expert popularity that cache is planned for; routed experts
        copied by the copy engine instead of read in place, no CUDA graphs).
        `gpu_memory` may be an `OffloadConfig` holding them (with device and pin_memory); WEIGHTSTREAM_CHECK
        turns on check mode as for `offload`.
        A compressed load codes each streamed group once, read from the shards one group at a time
        (on the GPU when `device` is one; a progress bar over groups).
    cache_dir: with compression and a disk tier, the folder of the compressed cache: one file
        (weightstream-*.blobs) holding the blobs of the disk groups that shrink, at most 0.95 of their
        raw bytes (about 0.71 for bf16 weights; `handle.stats.disk_wire_bytes`). Each forward reads
        those blobs instead of the raw tensors; groups that do not shrink are read from the
        safetensors. Default: a new temp folder (`tempfile.gettempdir()`, `$TMPDIR`). The file (and
        that temp folder) is deleted at `handle.restore()`.
    Returns the model, offloaded; `weightstream.handle_of(model)` gives its handle. On any error
    nothing stays allocated.

    A diffusers pipeline folder (`model_index.json` and a subfolder per component, as
    `DiffusionPipeline.save_pretrained` writes it) gives its `PipelineHandle` (`handle.pipe` is the
    pipeline): one `gpu_memory` and one `cpu_memory` over all its models, each loaded as above
    (`pipeline.load_pipeline`; dtype: every model's, default each in the dtype its weights are stored in;
    steps: the denoising steps per generation the split is planned for, default 28, as `weightstream
    plan --steps`; pipeline folders only).
    """
    config = config_of(gpu_memory, device=device, pin_memory=pin_memory, strategy=strategy, tokens=tokens,
                       profile=profile, compress=compress, expert_cache=expert_cache,
                       routing_skew=routing_skew, expert_copies=expert_copies)
    if is_pipeline_folder(path):  # a diffusers pipeline: each of its models built and loaded as below
        if steps is not None and steps < 1:
            raise ArgumentError(f"steps={steps}: a generation takes at least 1 denoising step")
        return load_pipeline(path, config, cpu_memory=cpu_memory, dtype=dtype, progress=progress,
                             cache_dir=cache_dir, steps=steps or DEFAULT_STEPS, build_context=params_on_meta,
                             load=load_into_place)
    if steps is not None:
        raise ArgumentError(f"steps={steps} is for a diffusers pipeline folder (denoising steps to plan "
                            f"for); {path} is a model checkpoint: drop steps")
    folder = checkpoint_folder(path)
    host_bytes = None if cpu_memory is None else parse_size(cpu_memory)
    model = build_model(folder, dtype)
    load_into_place(model, folder, config, host_bytes, cache_dir, progress)
    return model


@torch.inference_mode(False)  # the engine's tensors need version counters, even when offloaded in one
def load_into_place(model: nn.Module, folder: Path, config: OffloadConfig, host_bytes: int | None,
                    cache_dir: str | os.PathLike | None, progress: bool) -> OffloadHandle:
    """Read the checkpoint in `folder` straight into the final places of `model` (built with its
    parameters on the meta device), offloaded as `config` says; streamed groups beyond `host_bytes` of
    host memory (None: no limit) stay in the files (the disk tier). Returns the model's handle."""
    stored = read_index(folder)
    prep = prepare(model, config, allow_meta=True, host_bytes=host_bytes)
    pairs = _match(model, prep.entries, stored, folder)
    host_limit = None if host_bytes is None else host_bytes - sum(prep.uva_group_bytes)
    if host_limit is not None and host_limit < 0:  # the planner keeps to cpu_memory: a safety net
        raise BudgetError(
            f"cpu_memory={format_size(host_bytes)} cannot hold the zero-copy blocks "
            f"({format_size(sum(prep.uva_group_bytes))}), which must be in host memory: give more "
            "cpu_memory or strategy='stream'",
            sum(prep.uva_group_bytes),
        )
    on_disk = choose_disk_groups(prep.group_bytes, host_limit)
    disk = _disk_tier(prep, pairs, on_disk, folder) if on_disk else None
    pin = config.pin_memory and prep.device.type == "cuda"
    sizes, coded = prep.host_group_bytes, frozenset()
    if prep.placement.compressed:
        prep.wire, disk = coded_load.encode(prep, pairs, disk, cache_dir, progress)
        sizes = [enc.wire_bytes if enc else b for enc, b in zip(prep.wire, prep.group_bytes, strict=True)]
        sizes += prep.uva_group_bytes
        coded = frozenset(g for g, enc in enumerate(prep.wire) if enc is not None)
    coded_uva = expert_cache.coded_groups(prep)
    if coded_uva:  # routed experts held coded (expert copies with compress=True), one record per expert
        source_of = {id(entry): source for entry, source in pairs}

        def expert_groups():  # one zero-copy group's experts in host memory at a time, read twice
            return (coded_load.read_group(prep.uva_groups[j], prep.uva_group_bytes[j], source_of)
                    for j in coded_uva)

        landing = prep.placement.copy_landing_bytes
        uva_bytes = [prep.uva_group_bytes[j] for j in coded_uva]
        layouts = coded_experts.size_groups(expert_groups(), uva_bytes, landing, prep.device, progress)
        prep.coded_experts = dict(zip(coded_uva, layouts, strict=True))
        sizes = list(sizes)
        for j, records in prep.coded_experts.items():
            sizes[len(prep.groups) + j] = sum(r.nbytes for r in records)
        coded = coded | {len(prep.groups) + j for j in coded_uva}
    try:
        arena = HostArena([0 if g in on_disk else b for g, b in enumerate(sizes)], pin=pin,
                          device=prep.device)
    except BaseException:
        if disk is not None:
            disk.close()
        raise
    try:
        if prep.wire:
            prep.wire = coded_load.fill_host(arena, prep, pairs, prep.wire, disk)
        if coded_uva:
            regions = [arena.region(len(prep.groups) + j) for j in coded_uva]
            coded_experts.fill_groups(regions, expert_groups(), uva_bytes, layouts, landing, prep.device)
            for j in coded_uva:  # off the meta device before the caches view the work buffers: a meta
                for entry, _ in prep.uva_groups[j]:  # parameter is replaced by one sharing their version
                    _set_tensor(entry, torch.empty(0, dtype=entry.dtype))
        places = final_places(prep, arena, keep_on_device=True, disk_groups=on_disk | coded)
        _fill([p for p in pairs if id(p[0]) in places], places, progress)
        paired = {id(entry) for entry, _ in pairs}
        for entry in prep.entries:  # buffers computed at construction (rotary tables), not stored
            place = places.get(id(entry))  # none for a compressed or disk group's (in its blob)
            if id(entry) not in paired and place is not None and place is not entry.tensor.detach():
                place.copy_(entry.tensor)
        handle = finish(prep, arena, places, disk, pin, check=config.check)
    except BaseException:
        arena.close()
        if disk is not None:
            disk.close()
        raise
    return handle


def _disk_tier(prep, pairs, on_disk: frozenset[int], folder: Path) -> DiskTier:
    """The disk tier for the groups in `on_disk`: where each of their tensors (each stored piece of a
    fused one) lies in its shard."""
    source_of = {id(entry): source for entry, source in pairs}
    groups = {}
    for g in on_disk:
        groups[g] = []
        for entry, sl in prep.groups[g]:
            source = source_of[id(entry)]
            if source.dtype != entry.dtype:
                usual = max(Counter(e.dtype for e in prep.entries).items(), key=lambda kv: kv[1])[0]
                why = (f"load with dtype={str(source.dtype).removeprefix('torch.')!r}" if entry.dtype == usual
                       else f"the model class keeps it in {entry.dtype} whatever dtype is asked (as "
                       "transformers' _keep_in_fp32_modules do)")
                raise CheckpointError(
                    f"{folder}: the disk tier streams tensors as stored, and {entry.name} is stored in "
                    f"{source.dtype} where the model holds it in {entry.dtype}: {why}; or give cpu_memory "
                    "enough for every streamed group (no group then reads from disk)"
                )
            regions = source.regions(entry.dtype.itemsize)
            if regions is None:
                raise CheckpointError(
                    f"{folder}: {source.name} is converted from the checkpoint in a way the disk tier cannot "
                    "read in place: give cpu_memory enough for every streamed group (or no cpu_memory limit)")
            groups[g] += [(stored, Slice(sl.offset + at, stored.nbytes)) for stored, at in regions]
    return DiskTier(groups, {g: prep.group_bytes[g] for g in on_disk})
