"""`weightstream generate`: load a local checkpoint offloaded and generate from a prompt, then summarize.

A causal LM's checkpoint (`generate_text`) streams the generated text; with `speculate`, the text comes
from speculative decoding (`ws.generate`) and is printed at the end. A diffusers pipeline folder
(`generate_image`) is loaded straight into place and makes one image, saved as a PNG file."""

from __future__ import annotations

import inspect
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import OffloadConfig, config_of, refuse_unsplit_options
from .dtypes import parse_dtype
from .errors import ArgumentError, CheckpointError
from .formats.hf import checkpoint_folder, from_pretrained, model_class, read_config
from .offload import handle_of
from .pipeline import DENOISERS
from .placement.shapes import meta_model
from .sizes import format_size, parse_size
from .speculative import GenerationStats
from .speculative import generate as speculative_generate
from .speculative.budget import DraftSplit, plan_split
from .speculative.checks import check_generation_config, unapplied_settings
from .speculative.draft import DRAFT_NAMES
from .speculative.tree import parse_tree


@dataclass(frozen=True)
class GenerationSummary:
    """What one `generate` run did. Times in seconds."""

    new_tokens: int
    seconds: float
    first_token_seconds: float
    gpu_allocated_bytes: int | None
    pinned_bytes: int
    speculation: GenerationStats | None = None
    disk_bytes: int = 0  # streamed groups left in the checkpoint files (a cpu_memory limit)
    placement: str = ""  # what the planner did with the blocks off the GPU (`placement_summary`)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def __str__(self) -> str:
        gpu = "n/a (CPU)" if self.gpu_allocated_bytes is None else format_size(self.gpu_allocated_bytes)
        text = (f"{self.new_tokens} tokens in {self.seconds:.2f} s: {self.tokens_per_second:.2f} tokens/s, "
                f"time to first token {self.first_token_seconds * 1000:.0f} ms, GPU allocated {gpu}, "
                f"pinned {format_size(self.pinned_bytes)}")
        if self.disk_bytes:
            text += f", on disk {format_size(self.disk_bytes)}"
        if self.placement:
            text += f"; {self.placement}"
        spec = self.speculation
        if spec is not None:
            text += (f"; speculative ({spec.draft}, tree {spec.width}x{spec.depth}): {spec.passes} verify "
                     f"passes, {spec.accepted_per_pass:.2f} drafted tokens accepted per pass, draft "
                     f"{spec.draft_ms:.0f} ms, verify {spec.verify_ms:.0f} ms")
        return text


def placement_summary(handle) -> str:
    """One line on what the planner did with an offloaded model's blocks: streamed (compressed or raw),
    read in place, and a mixture of experts' routed experts copied (held compressed: their wire ratio)
    or cached on the GPU."""
    p = handle.placement

    def blocks(n: int) -> str:
        return f"{n} block{'' if n == 1 else 's'}"

    if p.kind == "resident":
        return "placement resident: every block on the GPU"
    text = (f"placement {p.kind}: {blocks(len(p.streamed))} streamed{' compressed' if p.compressed else ''}, "
            f"{len(p.uva)} read in place")
    caches = handle.expert_caches
    if caches is not None and caches.copies:
        ratio = handle.stats.expert_wire_ratio
        text += (f", routed experts of {blocks(len(caches.blocks))} copied each step"
                 + (f", held compressed (ratio {ratio:.2f})" if ratio is not None else ""))
    elif caches is not None:
        text += f", a GPU expert cache of {p.expert_slots} slots in {blocks(len(caches.blocks))}"
    elif p.uva_experts:
        text += f" ({len(p.uva_experts)} of them only their routed experts)"
    return text


def _load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(checkpoint_folder(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: no usable tokenizer in the folder ({err})") from None


def _timed_streamer(tokenizer, start: float, echo: bool):
    """A text streamer that prints tokens as they come and records when the first one came."""
    from transformers import TextStreamer

    class Streamer(TextStreamer):
        first: float | None = None
        count = 0

        def put(self, value):
            if self.next_tokens_are_prompt:
                return super().put(value)
            self.first = self.first or time.perf_counter() - start
            self.count += value.numel()
            if echo:
                super().put(value)

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            print(text, flush=True, end="" if not stream_end else None)

    return Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def _check_generates(cls: type, folder: os.PathLike) -> None:
    """Raise CheckpointError when `cls` (the class config.json names) cannot generate text."""
    can_generate = getattr(cls, "can_generate", None)
    if can_generate is not None and not can_generate():
        raise CheckpointError(
            f"{folder}: config.json names {cls.__name__}, which is not a causal LM (it has no generate()): "
            "weightstream generate needs a text-generation checkpoint whose `architectures` names a class "
            "such as LlamaForCausalLM; `weightstream plan FOLDER` plans any model")


def _load_draft(path: str | os.PathLike, dtype: torch.dtype, device: torch.device):
    """The draft checkpoint at `path`, resident on `device` in `dtype`."""
    from transformers import AutoModelForCausalLM

    folder = checkpoint_folder(path)
    _check_generates(model_class(read_config(folder), folder), folder)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype)
    return model.to(device).eval().requires_grad_(False)


def generate_text(
    path: str | os.PathLike,
    prompt: str,
    gpu_memory: int | str | OffloadConfig,
    *,
    max_new_tokens: int = 64,
    compile: bool | str = False,
    chat: bool = False,
    device: str | None = None,
    dtype: str | None = None,
    echo: bool = True,
    speculate: str | None = None,
    tree: str = "4x6",
    cpu_memory: int | str | None = None,
) -> GenerationSummary:
    """Load `path` offloaded under `gpu_memory`, generate greedily from `prompt`, print the text as it
    comes (when `echo`), and return the summary. compile: static KV cache and
    `torch.compile(fullgraph=True)` of the forward; "reduce-overhead" compiles it in that mode, so each
    step replays from a CUDA graph (on a GPU; on the CPU it is compiled alone). chat: wrap the prompt in
    the tokenizer's chat template. speculate: "prompt-lookup", "self" (the model's resident modules plus
    int4 copies, groups of 128, of the blocks it keeps off the GPU) or the folder of a draft checkpoint
    with the same tokenizer (loaded resident); the draft's weights count in `gpu_memory` (the split is
    printed on stderr when `echo`; `weightstream plan --speculate` shows it beforehand): speculative
    decoding with trees of `tree` ("WIDTHxDEPTH", or "auto": the shape the cost model predicts fastest, as
    `ws.generate(width="auto", depth="auto")`), a progress bar on stderr and the text printed at the
    end.
    cpu_memory: host memory for the offloaded weights, bytes or "16GiB", as for `from_pretrained` (None:
    no limit; groups beyond it are read from the checkpoint files every forward). Raises ArgumentError
    for an empty prompt or fewer than one new token, or with `speculate` for a generation_config.json
    setting speculative decoding does not apply (repetition_penalty...; the text would differ from plain
    decoding's) or, with a draft that takes GPU memory, for expert copies or expert_cache=False in
    `gpu_memory`'s config (the split plans without them), CheckpointError for a checkpoint of a model
    that does not generate text (an encoder such as BertModel), BudgetError for a draft that does not
    fit beside the model."""
    if not prompt:
        raise ArgumentError("--prompt is empty: give the text to continue, e.g. --prompt 'Hello'")
    if max_new_tokens < 1:
        raise ArgumentError(f"--max-new-tokens {max_new_tokens}: generate at least 1 token")
    if dtype is not None:
        parse_dtype(dtype)  # before anything is loaded
    width, depth = ("auto", "auto") if tree == "auto" else parse_tree(tree).dims
    if speculate is not None and speculate != "prompt-lookup":  # its draft's weights split the budget
        refuse_unsplit_options(config_of(gpu_memory, device=device), speculate)
    if speculate is not None and speculate not in DRAFT_NAMES:
        draft_folder = checkpoint_folder(speculate)  # a missing draft is found before the model loads
        _check_generates(model_class(read_config(draft_folder), draft_folder), draft_folder)
    folder = checkpoint_folder(path)
    _check_generates(model_class(read_config(folder), folder), folder)  # before the tokenizer or weights
    tokenizer = _load_tokenizer(path)
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise CheckpointError(f"{path}: the tokenizer has no chat template; drop --chat")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    if speculate is not None:  # before the weights load
        _check_speculative_generation_config(folder, ids.shape[1])
    split = None
    if speculate is not None and speculate != "prompt-lookup":  # the draft's weights in the same budget
        gpu_memory, split = _split_budget(folder, gpu_memory, speculate, dtype, device, cpu_memory)
        if echo:
            print(f"budget split: {split}", file=sys.stderr, flush=True)
    model = from_pretrained(path, gpu_memory, cpu_memory=cpu_memory, dtype=dtype, device=device)
    handle = handle_of(model)
    ids = ids.to(handle.device)
    if speculate is not None:
        return _speculate(model, tokenizer, ids, speculate, width, depth, max_new_tokens, compile, echo)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids),
                  pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id or 0, disable_compile=True)
    if compile:
        kwargs["cache_implementation"] = "static"
        mode = compile if isinstance(compile, str) else None
        model.forward = torch.compile(model.forward, fullgraph=True, mode=mode)
    start = time.perf_counter()
    streamer = _timed_streamer(tokenizer, start, echo)
    model.generate(ids, streamer=streamer, **kwargs)
    _synchronize(handle.device)
    seconds = time.perf_counter() - start
    return GenerationSummary(
        new_tokens=streamer.count,
        seconds=seconds,
        first_token_seconds=streamer.first or seconds,
        gpu_allocated_bytes=_allocated(handle.device),
        pinned_bytes=handle.stats.pinned_bytes,
        disk_bytes=handle.stats.disk_bytes,
        placement=placement_summary(handle),
    )


def _check_speculative_generation_config(folder: Path, prompt: int) -> None:
    """ArgumentError where the checkpoint's generation_config.json sets what changes greedy tokens and
    speculative generation does not apply (repetition_penalty, no_repeat_ngram_size...), naming each
    setting; `prompt`: the prompt's tokens. A checkpoint without the file is checked by `ws.generate`."""
    from transformers import GenerationConfig

    if not (folder / "generation_config.json").is_file():
        return
    config = GenerationConfig.from_pretrained(folder, local_files_only=True)
    found = unapplied_settings(config, prompt, stops=config.eos_token_id is not None, do_sample=False)
    json = {"None": "null", "False": "false"}
    settings = ", ".join(f'"{name}": {json.get(default, default)}' for name, (_, default) in found.items())
    check_generation_config(config, prompt, config.eos_token_id is not None, do_sample=False, remedy=(
        f"generate without --speculate (plain decoding applies {'them' if len(found) > 1 else 'it'}), or set "
        f"{settings} in {folder / 'generation_config.json'}"))


def _split_budget(folder: Path, gpu_memory: int | str | OffloadConfig, speculate: str, dtype: str | None,
                  device: str | None, cpu_memory: int | str | None) -> tuple[OffloadConfig, DraftSplit]:
    """The config that offloads the checkpoint in `folder` with the target's share of `gpu_memory`
    beside the draft `speculate` names ("self": int4 copies in groups of 128 of the blocks kept off the
    GPU; a draft folder: its weights), planned on the meta device (`speculative.budget.plan_split`),
    and the split. BudgetError where the draft does not fit beside the model."""
    config = config_of(gpu_memory, device=device)
    model = meta_model(str(folder), dtype)
    draft = speculate if speculate in DRAFT_NAMES else meta_model(speculate, next(model.parameters()).dtype)
    host_bytes = None if cpu_memory is None else parse_size(cpu_memory)
    split = plan_split(model, config, draft, host_bytes=host_bytes, allow_meta=True)
    return config.replace(gpu_memory=split.weights_budget, placement=split.placement), split


def _speculate(model, tokenizer, ids: torch.Tensor, speculate: str, width: int, depth: int,
               max_new_tokens: int, compile: bool | str, echo: bool) -> GenerationSummary:
    """`generate_text` by speculative decoding with the draft `speculate` names; the text printed at the
    end."""
    handle = handle_of(model)
    draft = (speculate if speculate in DRAFT_NAMES
             else _load_draft(speculate, model.dtype, handle.device))
    start = time.perf_counter()
    out = speculative_generate(model, ids, max_new_tokens, draft=draft, width=width, depth=depth,
                               compile=compile, progress=echo)
    seconds = time.perf_counter() - start
    if echo:
        print(tokenizer.decode(out.new_tokens, skip_special_tokens=True), flush=True)
    return GenerationSummary(
        new_tokens=out.stats.new_tokens,
        seconds=seconds,
        first_token_seconds=out.stats.prefill_ms / 1e3,
        gpu_allocated_bytes=_allocated(handle.device),
        pinned_bytes=handle.stats.pinned_bytes,
        speculation=out.stats,
        disk_bytes=handle.stats.disk_bytes,
        placement=placement_summary(handle),
    )


DEFAULT_IMAGE = "image.png"  # generate_image's file, in the current folder


@dataclass(frozen=True)
class ImageSummary:
    """What one `generate_image` run did. Times in seconds (step_ms: milliseconds per denoising step,
    None where the pipeline takes no step callback), sizes in bytes, width and height in pixels."""

    path: str
    width: int
    height: int
    steps: int
    load_seconds: float
    seconds: float
    step_ms: float | None
    gpu_allocated_bytes: int | None
    pinned_bytes: int
    disk_bytes: int

    def __str__(self) -> str:
        gpu = "n/a (CPU)" if self.gpu_allocated_bytes is None else format_size(self.gpu_allocated_bytes)
        per_step = "n/a" if self.step_ms is None else f"{self.step_ms:.0f} ms"
        text = (f"{self.path} ({self.width}x{self.height}): loaded in {self.load_seconds:.2f} s, generated "
                f"in {self.seconds:.2f} s, {self.steps} steps at {per_step} per step, GPU allocated {gpu}, "
                f"pinned {format_size(self.pinned_bytes)}")
        if self.disk_bytes:
            text += f", on disk {format_size(self.disk_bytes)}"
        return text


class _StepClock:
    """Times the denoising steps of one generation, from the denoiser's first call to the end of the last
    step: CUDA events on a GPU (nothing waits for the GPU during the steps), the host clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.start = self.end = None
        self.steps = 0

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def first_call(self, module, args) -> None:
        """A forward pre-hook on the denoiser."""
        if self.start is None:
            self.start = self._now()

    def step_end(self, pipe, step: int, timestep, tensors: dict) -> dict:
        """diffusers' `callback_on_step_end`: changes nothing."""
        self.steps += 1
        self.end = self._now()
        return {}

    def ms_per_step(self) -> float | None:
        """Milliseconds per step, after the generation (the GPU synchronized); None when no step ran."""
        if self.start is None or self.end is None or not self.steps:
            return None
        ms = self.start.elapsed_time(self.end) if self.cuda else (self.end - self.start) * 1e3
        return ms / self.steps


def generate_image(
    path: str | os.PathLike,
    prompt: str,
    gpu_memory: int | str | OffloadConfig,
    *,
    cpu_memory: int | str | None = None,
    steps: int | None = None,
    size: int | None = None,
    seed: int = 0,
    out: str | os.PathLike = DEFAULT_IMAGE,
    dtype: str | None = None,
    device: str | None = None,
    progress: bool = True,
) -> ImageSummary:
    """Load the diffusers pipeline folder `path` straight into place (`from_pretrained`: its weights
    never all in host memory) under `gpu_memory` and `cpu_memory` (bytes or "16GiB"; None: no limit,
    else streamed groups beyond it stay in their files), make one image from `prompt` and save it as a
    PNG file at `out` (replaced if it exists); return the summary.

    steps: denoising steps (default: the pipeline's own). size: the image's width and height in pixels
    (default: the pipeline's own). seed: of a CPU generator, so a seed gives the same starting noise on
    any device. dtype: every component's (default: each in the dtype its weights are stored in).
    progress: the load's progress bars (diffusers' step bar is the pipeline's own setting). The
    generation is timed on its own, and its denoising steps from the denoiser's first call to the end
    of the last step. Raises ArgumentError for an empty prompt, steps or size below 1, an `out` that is
    not a .png file in an existing folder, or a request the pipeline refuses (a size it cannot make);
    CheckpointError for a pipeline that makes no images (a video pipeline)."""
    if not prompt:
        raise ArgumentError("--prompt is empty: describe the image, e.g. --prompt 'a red cat'")
    if steps is not None and steps < 1:
        raise ArgumentError(f"--steps {steps}: a generation takes at least 1 denoising step")
    if size is not None and size < 1:
        raise ArgumentError(f"--size {size}: give the image's width and height in pixels, e.g. --size 1024")
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise ArgumentError(f"--out {out}: the image is saved as PNG; give a file name ending in .png")
    if not out.parent.is_dir():
        raise ArgumentError(f"--out {out}: the folder {out.parent} does not exist; create it or give another")
    if dtype is not None:
        parse_dtype(dtype)  # before anything is loaded
    start = time.perf_counter()
    handle = from_pretrained(path, gpu_memory, cpu_memory=cpu_memory, dtype=dtype, device=device,
                             progress=progress, steps=steps)  # the split planned for these steps
    on = next(iter(handle.handles.values())).device
    _synchronize(on)
    load_seconds = time.perf_counter() - start
    pipe = handle.pipe
    kwargs = {"generator": torch.Generator().manual_seed(seed)}
    if steps is not None:
        kwargs["num_inference_steps"] = steps
    if size is not None:
        kwargs["height"] = kwargs["width"] = size
    clock = _StepClock(on)
    hooks = []
    if "callback_on_step_end" in inspect.signature(pipe.__call__).parameters:
        kwargs["callback_on_step_end"] = clock.step_end
        denoiser = next((handle.pipe.components[n] for n in DENOISERS if n in handle.handles), None)
        if denoiser is not None:
            hooks.append(denoiser.register_forward_pre_hook(clock.first_call))
    start = time.perf_counter()
    try:
        result = pipe(prompt, **kwargs)
    except ValueError as err:  # diffusers' check of the request (a size it cannot make...)
        first = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
        raise ArgumentError(f"{type(pipe).__name__} refuses this request ({first}): change --size or "
                            "--steps") from None
    finally:
        for hook in hooks:
            hook.remove()
    _synchronize(on)
    seconds = time.perf_counter() - start
    images = getattr(result, "images", None)
    if images is None or len(images) == 0 or not hasattr(images[0], "save"):
        raise CheckpointError(f"{path}: {type(pipe).__name__} gives no images (a video pipeline gives "
                              "frames): weightstream generate saves one image; call this pipeline in Python")
    image = images[0]
    image.save(out, format="PNG")
    stats = handle.stats.components.values()
    return ImageSummary(
        path=str(out), width=image.width, height=image.height,
        steps=clock.steps or steps or 0, load_seconds=load_seconds, seconds=seconds,
        step_ms=clock.ms_per_step(),
        gpu_allocated_bytes=_allocated(on),
        pinned_bytes=sum(s.pinned_bytes for s in stats), disk_bytes=sum(s.disk_bytes for s in stats),
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int | None:
    """Bytes torch has allocated on `device` now; None on the CPU."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None
