"""`weightstream generate`: load a local checkpoint offloaded, stream the generated text, summarize.
With `speculate`, the text comes from speculative decoding (`ws.generate`) and is printed at the end."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from .config import OffloadConfig
from .dtypes import parse_dtype
from .errors import ArgumentError, CheckpointError
from .formats.hf import checkpoint_folder, from_pretrained, model_class, read_config
from .offload import handle_of
from .sizes import format_size
from .speculative import GenerationStats
from .speculative import generate as speculative_generate
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

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def __str__(self) -> str:
        gpu = "n/a (CPU)" if self.gpu_allocated_bytes is None else format_size(self.gpu_allocated_bytes)
        text = (f"{self.new_tokens} tokens in {self.seconds:.2f} s: {self.tokens_per_second:.2f} tokens/s, "
                f"time to first token {self.first_token_seconds * 1000:.0f} ms, GPU allocated {gpu}, "
                f"pinned {format_size(self.pinned_bytes)}")
        spec = self.speculation
        if spec is not None:
            text += (f"; speculative ({spec.draft}, tree {spec.width}x{spec.depth}): {spec.passes} verify "
                     f"passes, {spec.accepted_per_pass:.2f} drafted tokens accepted per pass, draft "
                     f"{spec.draft_ms:.0f} ms, verify {spec.verify_ms:.0f} ms")
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
    compile: bool = False,
    chat: bool = False,
    device: str | None = None,
    dtype: str | None = None,
    echo: bool = True,
    speculate: str | None = None,
    tree: str = "4x6",
) -> GenerationSummary:
    """Load `path` offloaded under `gpu_memory`, generate greedily from `prompt`, print the text as it
    comes (when `echo`), and return the summary. compile: static KV cache and
    `torch.compile(fullgraph=True)` of the forward. chat: wrap the prompt in the tokenizer's chat
    template. speculate: "prompt-lookup" or the folder of a draft checkpoint with the same tokenizer
    (loaded resident): speculative decoding with trees of `tree` ("WIDTHxDEPTH") tokens, a progress bar
    on stderr and the text printed at the end. Raises ArgumentError for an empty prompt or fewer than one
    new token, CheckpointError for a checkpoint of a model that does not generate text (an encoder such
    as BertModel)."""
    if not prompt:
        raise ArgumentError("--prompt is empty: give the text to continue, e.g. --prompt 'Hello'")
    if max_new_tokens < 1:
        raise ArgumentError(f"--max-new-tokens {max_new_tokens}: generate at least 1 token")
    if dtype is not None:
        parse_dtype(dtype)  # before anything is loaded
    width, depth = parse_tree(tree).dims
    if speculate is not None and speculate != "prompt-lookup":
        draft_folder = checkpoint_folder(speculate)  # a missing draft is found before the model loads
        _check_generates(model_class(read_config(draft_folder), draft_folder), draft_folder)
    folder = checkpoint_folder(path)
    _check_generates(model_class(read_config(folder), folder), folder)  # before the tokenizer or weights
    tokenizer = _load_tokenizer(path)
    model = from_pretrained(path, gpu_memory, dtype=dtype, device=device)
    handle = handle_of(model)
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise CheckpointError(f"{path}: the tokenizer has no chat template; drop --chat")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    ids = ids.to(handle.device)
    if speculate is not None:
        return _speculate(model, tokenizer, ids, speculate, width, depth, max_new_tokens, compile, echo)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids),
                  pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id or 0, disable_compile=True)
    if compile:
        kwargs["cache_implementation"] = "static"
        model.forward = torch.compile(model.forward, fullgraph=True)
    start = time.perf_counter()
    streamer = _timed_streamer(tokenizer, start, echo)
    model.generate(ids, streamer=streamer, **kwargs)
    if handle.device.type == "cuda":
        torch.cuda.synchronize(handle.device)
    seconds = time.perf_counter() - start
    return GenerationSummary(
        new_tokens=streamer.count,
        seconds=seconds,
        first_token_seconds=streamer.first or seconds,
        gpu_allocated_bytes=(
            torch.cuda.memory_allocated(handle.device) if handle.device.type == "cuda" else None
        ),
        pinned_bytes=handle.stats.pinned_bytes,
    )


def _speculate(model, tokenizer, ids: torch.Tensor, speculate: str, width: int, depth: int,
               max_new_tokens: int, compile: bool, echo: bool) -> GenerationSummary:
    """`generate_text` by speculative decoding with the draft `speculate` names; the text printed at the
    end."""
    handle = handle_of(model)
    draft = (speculate if speculate == "prompt-lookup"
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
        gpu_allocated_bytes=(
            torch.cuda.memory_allocated(handle.device) if handle.device.type == "cuda" else None
        ),
        pinned_bytes=handle.stats.pinned_bytes,
        speculation=out.stats,
    )
