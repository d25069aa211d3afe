"""`generate()`: speculative decoding of a causal LM, offloaded or not, one verify forward per pass.

Each pass: the draft proposes a tree of `1 + width * depth` tokens rooted at the last token emitted;
one forward of the model over the tree (tree attention mask, positions by depth, keys and values
written after the committed ones) gives the target's logits at every node; acceptance walks the tree
(greedy, or rejection sampling); the accepted path's keys and values are moved into place and the rest
are left to be overwritten. A pass emits the accepted tokens plus the target's own next one. While an
offloaded forward is bound by the weights crossing the link, a tree of many tokens costs about what
one token costs, so every accepted token is a pass saved.
"""

from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import ArgumentError
from ..sizes import format_size, parse_size
from .acceptance import target_probs, walk_greedy, walk_sampled
from .cache import TreeCache
from .checks import (
    check_causal_lm,
    check_draft_vocabulary,
    check_generation_config,
    check_length,
    check_memory,
    check_positions,
    check_sampling,
    check_tree_argument,
    generation_bytes,
    max_depth,
)
from .draft import resolve_draft
from .draft_model import DraftModel
from .self_draft import SelfDraft
from .shape_choice import estimate_acceptance
from .shape_costs import auto_shape
from .tree import TreeShape, path_moves, tree_mask, tree_positions
from .verify import TreeForward

# a compiled generation's cache is a multiple of this many positions, so that prompts of different
# lengths reuse one compiled verify (and draft) forward instead of compiling again for each length
# (torch.compile stops compiling after a few recompiles of a frame and then runs it eagerly)
CACHE_BUCKET = 256

@dataclass(frozen=True)
class GenerationStats:
    """What one `generate` did. accepted: drafted tokens the target accepted in each pass (a pass emits
    those plus one). Times in milliseconds (host clock; each pass waits for its results anyway)."""

    new_tokens: int
    passes: int
    accepted: tuple[int, ...]
    prefill_ms: float
    draft_ms: float
    verify_ms: float
    total_ms: float
    width: int
    depth: int
    draft: str
    draft_bytes: int = 0  # bytes the draft holds on the device: low-bit copies, a draft model and its cache
    # width="auto" / depth="auto": the decode tokens/s the cost model predicted for the chosen shape
    # (`shape_choice.py`), beside the measured `decode_tokens_per_second`; None for a shape given
    predicted_tokens_per_second: float | None = None
    # the same model's prediction for plain decoding (one token per verify forward); where it is the
    # higher, generate warned (`warn_if_slower`)
    predicted_plain_tokens_per_second: float | None = None
    # (width, depth, passes) of each shape run, in order: two where an automatic shape was chosen again
    # from the measured acceptance and came out different
    shapes: tuple[tuple[int, int, int], ...] = ()
    # the per-level acceptance measured over the first passes that the shape was chosen again with
    measured_acceptance: float | None = None

    @property
    def tree_tokens(self) -> int:
        """Tokens of each verify forward (of the last shape, where the shape was chosen again)."""
        return 1 + self.width * self.depth

    @property
    def accepted_per_pass(self) -> float:
        """Mean drafted tokens accepted per verify pass."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Mean tokens emitted per verify pass (accepted + 1, fewer where the end was reached)."""
        return (self.new_tokens - 1) / self.passes if self.passes else 0.0

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second of the whole call, prefill included."""
        return self.new_tokens / self.total_ms * 1e3 if self.total_ms else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens per second of the passes (draft and verify ms; the prefill's token left out): what
        `predicted_tokens_per_second` predicts."""
        ms = self.draft_ms + self.verify_ms
        return (self.new_tokens - 1) / ms * 1e3 if ms else 0.0

    def __str__(self) -> str:
        return (f"{self.new_tokens} tokens in {self.total_ms / 1e3:.2f} s "
                f"({self.tokens_per_second:.2f} tokens/s): "
                f"{self.passes} verify passes of {self.tree_tokens} tokens (draft {self.draft}, width "
                f"{self.width}, depth {self.depth}), {self.accepted_per_pass:.2f} drafted tokens accepted "
                f"per pass; prefill {self.prefill_ms:.0f} ms, draft {self.draft_ms:.0f} ms, verify "
                f"{self.verify_ms:.0f} ms" + (f"; draft weights {format_size(self.draft_bytes)} on the device"
                                              if self.draft_bytes else "")
                + (f"; shape chosen by the cost model, predicted {self.predicted_tokens_per_second:.2f} "
                   f"decode tokens/s (plain decoding {self.predicted_plain_tokens_per_second:.2f}), "
                   f"measured {self.decode_tokens_per_second:.2f}"
                   if self.predicted_tokens_per_second is not None else "")
                + (f"; chosen again after {self.shapes[0][2]} passes from the measured acceptance "
                   f"{self.measured_acceptance:.2f}: "
                   + " then ".join(f"{w}x{d} ({n} passes)" for w, d, n in self.shapes)
                   if len(self.shapes) > 1 else ""))


@dataclass(frozen=True)
class Generation:
    """tokens: (1, prompt + new) int64, on the CPU; logits: (new, vocab), the target's logits each new
    token was chosen from (when asked for), else None."""

    tokens: torch.Tensor
    stats: GenerationStats
    logits: torch.Tensor | None = field(default=None, repr=False)

    @property
    def new_tokens(self) -> torch.Tensor:
        """(new,) int64: the generated tokens alone."""
        return self.tokens[0, self.tokens.shape[1] - self.stats.new_tokens:]


def _eos_ids(model, eos_token_id) -> set[int]:
    if eos_token_id is None:
        config = getattr(model, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, torch.Tensor):  # as transformers accepts it: a 0-d or 1-d tensor
        eos_token_id = eos_token_id.reshape(-1).tolist()
    return {int(t) for t in ([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)}


def _device(model: nn.Module) -> torch.device:
    return model.get_input_embeddings().weight.device


def cache_length(prompt: int, max_new_tokens: int, room_tokens: int, room_depth: int,
                 compile: bool | str) -> int:
    """Positions of a generation's KV cache: the prompt, the new tokens, and the last pass's tree
    (`room_tokens` slots, `room_depth` levels past the last token); compiled, rounded up to a multiple
    of CACHE_BUCKET, since compiled forwards are shaped by the cache and prompts of similar length then
    share one graph."""
    length = max(prompt + max_new_tokens + room_depth, prompt + max_new_tokens - 1 + room_tokens)
    return -(-length // CACHE_BUCKET) * CACHE_BUCKET if compile else length


def warn_if_slower(choice, auto, draft: str, acceptance: str) -> bool:
    """Warn where the chosen shape's predicted tokens/s is below plain decoding's (a draft step too
    costly beside the verify forward, or too little accepted); True when it warned."""
    plain = auto.plain_tokens_per_second
    if choice.tokens_per_second >= plain:
        return False
    cheaper = "" if draft == "prompt-lookup" else ", or a cheaper draft (prompt-lookup)"
    warnings.warn(
        f"weightstream: speculative decoding with the {draft} draft is predicted slower than plain "
        f"decoding here ({acceptance} acceptance {choice.acceptance:.2f} a level): "
        f"{choice.tokens_per_second:.3g} against {plain:.3g} tokens/s for the best tree, {choice.width}x"
        f"{choice.depth}, whose draft steps take {choice.draft_ms:.3g} ms beside a {choice.verify_ms:.3g} "
        f"ms verify forward; it goes on as asked: pass draft=None for one token per pass{cheaper}",
        stacklevel=3)
    return True


def _sampling(model: nn.Module, temperature, top_k, top_p) -> tuple:
    """temperature, top_k and top_p as transformers' generate takes them: each given, or else the
    model's generation_config's, or else transformers' global defaults (`GenerationConfig.
    _get_default_generation_params`: temperature 1.0, top_k 50, top_p 1.0 in transformers 5)."""
    from transformers import GenerationConfig

    config = getattr(model, "generation_config", None)
    defaults = getattr(GenerationConfig, "_get_default_generation_params", dict)()

    def given(value, name):
        for source in (value, getattr(config, name, None), defaults.get(name)):
            if source is not None:
                return source
        return None

    temperature = given(temperature, "temperature")
    return 1.0 if temperature is None else temperature, given(top_k, "top_k"), given(top_p, "top_p")


def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int = 64,
    *,
    draft: object = "prompt-lookup",
    width: int | str = 4,
    depth: int | str = 6,
    do_sample: bool = False,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | list[int] | torch.Tensor | None = None,
    compile: bool | str = False,
    cache_memory: int | str | None = None,
    output_logits: bool = False,
    progress: bool = False,
    rechoose_after: int | None = 8,
) -> Generation:
    """Generate up to `max_new_tokens` tokens after `input_ids` (1, prompt) or (prompt,) with speculative
    decoding; `model` is a causal LM, offloaded with `ws.offload` or resident.

    draft: "prompt-lookup" (n-grams of the context, no weights), "self" (the model's resident modules
    plus int4 copies, groups of 128, of the blocks it keeps off the GPU; `SelfDraft(bits, group)` for
    others, and to keep the copies for later calls), a small causal LM with the model's tokenizer (an
    nn.Module, on the model's device), None (one token per pass) or a `Draft`.
    width, depth: the tree of every verify pass, `1 + width * depth` tokens (width 1: a chain); "auto"
    for either: chosen once, before the prefill, to maximise the decode tokens/s the placement's cost
    model predicts with the draft's prior acceptance (`shape_choice.py`; widths 1..8, depths 1..24,
    trees of at most 128 tokens), reported in `stats.predicted_tokens_per_second` beside plain
    decoding's prediction (a UserWarning where the best tree is predicted slower); chosen once more
    after `rechoose_after` passes (None: never) from the acceptance those passes measured, kept for the
    rest of the call (a compiled forward compiles once more where the shape changes; `stats.shapes`).
    do_sample: rejection sampling from the model's distribution under temperature / top_k / top_p (as
    transformers' generate; each not given, None, is the model's generation_config's, else transformers'
    default, as there: 1.0, top-k 50, no top-p; top_k 0 and top_p 1.0 turn them off), drawn from `generator`
    (a CPU torch.Generator; seeded runs repeat); else
    greedy: the tokens equal the model's own greedy decoding wherever a forward over the tree ranks the
    tokens as a one-token forward does. eos_token_id: stop after it (default: the model's
    generation_config). compile: torch.compile(fullgraph=True) of the verify and draft forwards, or a
    compile mode ("reduce-overhead": CUDA graphs); the prefill runs eagerly; the KV cache is then
    rounded up to a multiple of CACHE_BUCKET positions, so later calls whose prompt and new tokens fit
    the same multiple reuse the compiled forwards (another multiple compiles once more). cache_memory:
    bytes (or "2GiB") the KV caches, a verify pass and a self-draft's low-bit copies may take (default:
    the GPU's free memory; no limit on the CPU). output_logits: keep the logits each token was chosen from.
    progress: a tqdm bar with tokens/s.

    Settings of `model.generation_config` that change transformers' tokens other than eos_token_id
    (repetition_penalty, no_repeat_ngram_size, suppress_tokens, bad_words_ids, sequence_bias,
    min_new_tokens, forced_eos_token_id, num_beams...: `checks.UNAPPLIED_SETTINGS`) are not applied, so
    they are refused.

    Raises ArgumentError for a model that is not a causal LM, a draft of another vocabulary, a tree or
    length the model cannot take, a generation_config setting it does not apply, a sampling argument
    transformers refuses, positions it cannot give as transformers does (GPT-Neo's local layers, ALiBi
    with a tree, LongRoPE crossing its switch); BudgetError where the caches (and a self-draft's copies)
    do not fit (with the bytes they need).
    """
    vocab = check_causal_lm(model)
    ids = input_ids.reshape(1, -1) if input_ids.dim() == 1 else input_ids
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ArgumentError(f"input_ids of shape {tuple(input_ids.shape)}: give one non-empty prompt, (1, "
                            "tokens) or (tokens,); speculative generation runs batch 1")
    if max_new_tokens < 1:
        raise ArgumentError(f"max_new_tokens={max_new_tokens}: generate at least 1 token")
    temperature, top_k, top_p = _sampling(model, temperature, top_k, top_p)
    check_sampling(do_sample, temperature, top_k, top_p)
    eos = _eos_ids(model, eos_token_id)
    check_generation_config(getattr(model, "generation_config", None), ids.shape[1], bool(eos), do_sample)
    if generator is not None and generator.device.type != "cpu":
        raise ArgumentError(f"a generator on {generator.device}: acceptance draws on the host, give "
                            "torch.Generator() (on the CPU), seeded as you like")
    drafter = resolve_draft(draft, compile)
    check_tree_argument("width", width)
    check_tree_argument("depth", depth)
    if rechoose_after is not None and (not isinstance(rechoose_after, int) or isinstance(rechoose_after, bool)
                                       or rechoose_after < 1):
        raise ArgumentError(f"rechoose_after={rechoose_after!r}: give a number of passes of at least 1, or "
                            "None to keep the first automatic shape")
    auto = choice = None
    warned = False
    if draft is not None:
        TreeShape(1 if width == "auto" else width, 0 if depth == "auto" else depth)  # a bad integer: now
        auto = auto_shape(model, drafter, width, depth,
                          max_depth(model.config, ids.shape[1], max_new_tokens), compile)
        choice = auto.choose() if auto is not None else None
        warned = choice is not None and warn_if_slower(choice, auto, drafter.name, "prior")  # once a call
    shape = (TreeShape(choice.width, choice.depth) if choice is not None
             else TreeShape(width, depth) if draft is not None else TreeShape(1, 0))
    rechoose = auto is not None and rechoose_after is not None
    # a shape chosen again may be any candidate: the caches and the logits are sized for the largest
    room_tokens, room_depth = auto.largest if rechoose else (shape.tokens, shape.depth)
    draft_model = drafter.model if isinstance(drafter, DraftModel) else None
    if draft_model is not None:
        check_draft_vocabulary(vocab, check_causal_lm(draft_model, "draft"))
    prompt = ids[0].to("cpu", torch.long)
    positions = check_length(model.config, prompt.numel(), max_new_tokens, room_depth)
    check_positions(model, prompt.numel(), positions, tree=room_tokens > 1)
    if draft_model is not None:
        check_length(draft_model.config, prompt.numel(), max_new_tokens, room_depth)
    length = cache_length(prompt.numel(), max_new_tokens, room_tokens, room_depth, compile)
    device = _device(model)
    need = generation_bytes(model, draft_model, length, room_tokens, vocab)
    self_draft = drafter if isinstance(drafter, SelfDraft) else None
    building = self_draft.needed_bytes(model) if self_draft is not None else 0  # 0 once built
    name = self_draft.name if self_draft is not None else ""
    if cache_memory is not None:
        check_memory(need, parse_size(cache_memory), "cache_memory", building, name)
    elif device.type == "cuda":
        check_memory(need, torch.cuda.mem_get_info(device)[0], f"{device} (free)", building, name)
    if draft_model is not None and _device(draft_model) != device:
        raise ArgumentError(f"the draft model is on {_device(draft_model)} and the model on {device}: move "
                            f"the draft to {device} (it stays resident)")

    cache = TreeCache(model.config.num_hidden_layers, length)
    forward = TreeForward(model, cache, device, model.dtype, compile)
    if self_draft is not None:
        self_draft.bind(model, cache, compile)  # builds it once; it drafts into the model's own cache
    kept: list[torch.Tensor] = []

    def choose(logits: torch.Tensor) -> int:
        if not do_sample:
            return int(logits.argmax())
        probs = target_probs(logits[None], temperature, top_k, top_p)[0].to("cpu", torch.float64)
        return int(torch.multinomial(probs, 1, generator=generator))

    from tqdm.auto import tqdm

    bar = tqdm(total=max_new_tokens, desc="generate", unit="tok", disable=not progress, file=sys.stderr)
    began = time.perf_counter()
    logits = forward.prefill(prompt)[-1]
    drafter.begin(prompt, length, device)
    emitted = [choose(logits)]
    if output_logits:
        kept.append(logits[None].cpu())
    prefill_ms = (time.perf_counter() - began) * 1e3
    bar.update(1)
    accepted: list[int] = []
    runs = [[shape.width, shape.depth, 0]]  # (width, depth, passes) of each shape run
    measured = None
    draft_ms = verify_ms = 0.0
    context = torch.cat([prompt, torch.tensor(emitted)])
    while len(emitted) < max_new_tokens and emitted[-1] not in eos:
        start = context.numel() - 1  # the root's position: every token before it is in the cache
        t0 = time.perf_counter()
        tree = drafter.propose(context, shape)
        t1 = time.perf_counter()
        logits = forward.run(tree.tokens, tree_positions(shape, start), torch.arange(shape.tokens) + start,
                             tree_mask(tree, start, length))
        if do_sample:
            probs = target_probs(logits, temperature, top_k, top_p)
            path, token = walk_sampled(tree, lambda node, p=probs: p[node].to("cpu", torch.float64),
                                       generator)
        else:
            path, token = walk_greedy(tree, logits.argmax(dim=-1).cpu())
        src, dst = path_moves(path, start, shape.depth)
        cache.move(src, dst)
        drafter.accept(path, start)
        t2 = time.perf_counter()
        draft_ms += (t1 - t0) * 1e3
        verify_ms += (t2 - t1) * 1e3
        accepted.append(len(path) - 1)
        runs[-1][2] += 1
        if rechoose and measured is None and len(accepted) == rechoose_after:
            measured = estimate_acceptance(accepted, shape.width, shape.depth, auto.prior)
            choice = auto.choose(measured)
            warned = warned or warn_if_slower(choice, auto, drafter.name, "measured")
            if (choice.width, choice.depth) != shape.dims:  # one shape at a time, static from here on
                shape = TreeShape(choice.width, choice.depth)
                runs.append([shape.width, shape.depth, 0])
        new = [int(tree.tokens[n]) for n in path[1:]] + [token]
        stop = next((i for i, t in enumerate(new) if t in eos), len(new) - 1) + 1
        keep = min(stop, max_new_tokens - len(emitted))
        new, rows = new[:keep], path[:keep]
        emitted += new
        if output_logits:
            kept.append(logits[rows].cpu())
        context = torch.cat([context, torch.tensor(new)])
        bar.update(len(new))
        elapsed = time.perf_counter() - began
        bar.set_postfix(tok_s=f"{len(emitted) / elapsed:.2f}",
                        accepted=f"{sum(accepted) / len(accepted):.2f}")
    bar.close()
    stats = GenerationStats(
        new_tokens=len(emitted), passes=len(accepted), accepted=tuple(accepted), prefill_ms=prefill_ms,
        draft_ms=draft_ms, verify_ms=verify_ms, total_ms=(time.perf_counter() - began) * 1e3,
        width=shape.width, depth=shape.depth, draft=drafter.name,
        draft_bytes=drafter.device_bytes() if hasattr(drafter, "device_bytes") else 0,
        predicted_tokens_per_second=choice.tokens_per_second if choice is not None else None,
        predicted_plain_tokens_per_second=auto.plain_tokens_per_second if auto is not None else None,
        shapes=tuple(tuple(run) for run in runs), measured_acceptance=measured)
    return Generation(context[None], stats, torch.cat(kept) if output_logits else None)
