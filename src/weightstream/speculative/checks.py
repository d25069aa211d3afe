"""What `generate` refuses before it runs a forward, each with the change that fixes it."""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ArgumentError, BudgetError
from ..sizes import format_size
from .cache import kv_bytes


def check_causal_lm(model, what: str = "model") -> int:
    """Raise ArgumentError unless `model` is a decoder-only causal LM whose layers attend fully or over a
    sliding window (`attention_masks`); return its vocabulary size (the width of its logits)."""
    head = model.get_output_embeddings() if isinstance(model, nn.Module) and hasattr(
        model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    can_generate = getattr(model, "can_generate", None)
    if (head is None or config is None or getattr(config, "is_encoder_decoder", False)
            or (can_generate is not None and not can_generate())):
        raise ArgumentError(
            f"the {what} ({type(model).__name__}) is not a causal LM: speculative generation needs a "
            "decoder-only transformers model with a language-model head, such as LlamaForCausalLM "
            "(load it with AutoModelForCausalLM)")
    attention_masks(model, what)
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    if attention not in ("eager", "sdpa"):
        raise ArgumentError(
            f"the {what} attends with {attention!r}, which takes no 4-D tree mask: load it with "
            "attn_implementation='sdpa' (or 'eager') for speculative generation")
    return head.weight.shape[0]


MASKED_KINDS = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class AttentionMasks:
    """How a model's forward takes the 4-D masks of a tree pass. kind: "full" (one mask, every layer
    attends to the whole cache), "sliding" (one mask, every layer over a window of `window` positions)
    or "per-layer-type" (a dict {"full_attention": m, "sliding_attention": m2}, each layer picking its
    own by its `layer_types` entry)."""

    kind: str
    window: int | None = None


def attention_masks(model, what: str = "model") -> AttentionMasks:
    """The masks `model`'s forward takes (`AttentionMasks`); ArgumentError for layer kinds a tree mask
    cannot express (linear attention, chunked attention, state-space layers)."""
    config = model.config
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_bidirectional_attention", False):
        raise ArgumentError(f"the {what} ({type(model).__name__}) attends bidirectionally (an embedding "
                            "model): speculative generation needs a causal LM")
    kinds = set(getattr(config, "layer_types", None) or ())
    if kinds - set(MASKED_KINDS):
        raise ArgumentError(
            f"the {what} ({type(model).__name__}) has layers of kinds {sorted(kinds)}: speculative "
            f"generation verifies trees over layers of {' and '.join(MASKED_KINDS)} only (its KV cache "
            "and 4-D masks); generate with model.generate() instead")
    source = _decoder_source(model)
    if "sliding_attention" in kinds:
        # transformers' decoders with mixed layers take a dict of masks keyed by layer type; one that
        # builds its own masks whatever it is given would ignore the tree's
        if "full_attention" in kinds and not re.search(r"isinstance\(\w+ := attention_mask, dict\)", source):
            raise ArgumentError(
                f"the {what} ({type(model).__name__}) mixes sliding-window and full layers but its forward "
                "takes no mask per layer type: generate with model.generate() instead")
        return AttentionMasks("per-layer-type" if "full_attention" in kinds else "sliding", window)
    if not kinds and window is not None and "create_sliding_window_causal_mask" in source:
        return AttentionMasks("sliding", window)  # Mistral, Mixtral: one window for every layer
    return AttentionMasks("full")


def _decoder_source(model) -> str:
    """The source of the forward that builds the masks (the base decoder's), or "" where none is found."""
    base = getattr(model, "base_model", model)
    try:
        return inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return ""


def check_draft_vocabulary(model_vocab: int, draft_vocab: int) -> None:
    """Raise ArgumentError where a draft model's logits are not over the model's vocabulary."""
    if draft_vocab != model_vocab:
        raise ArgumentError(
            f"the draft's vocabulary has {draft_vocab} tokens and the model's {model_vocab}: a draft "
            "model must use the model's tokenizer (pick one of the same family, or draft='prompt-lookup')")


def check_length(config, prompt: int, max_new_tokens: int, depth: int) -> int:
    """The cache positions a generation needs (the prompt, the new tokens, a tree's levels past the
    last one); ArgumentError where its positions go past the model's `max_position_embeddings`."""
    positions = prompt + max_new_tokens + depth
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and positions > limit:
        raise ArgumentError(
            f"a prompt of {prompt} tokens, max_new_tokens={max_new_tokens} and a tree {depth} deep reach "
            f"position {positions}, past the model's {limit} (max_position_embeddings): lower "
            "max_new_tokens or depth, or shorten the prompt")
    return positions


def max_depth(config, prompt: int, max_new_tokens: int) -> int | None:
    """The deepest tree (levels) whose positions stay within the model's `max_position_embeddings`
    after a prompt of `prompt` tokens and `max_new_tokens` new ones; None where the model names no
    limit."""
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return None if limit is None else limit - prompt - max_new_tokens


def check_tree_argument(name: str, value) -> None:
    """ArgumentError for a `width` or `depth` given as a string other than "auto" (integers are checked
    by `TreeShape`)."""
    if isinstance(value, str) and value != "auto":
        raise ArgumentError(f"{name}={value!r}: give an integer, or 'auto' for the shape the cost model "
                            "predicts fastest")


def check_memory(need: int, available: int | None, where: str, draft_bytes: int = 0, draft: str = "") -> None:
    """BudgetError where the generation's KV caches and tree activations (`need`, bytes) plus the
    low-bit copies a self-draft is about to build (`draft_bytes`, bytes; `draft` names its scheme)
    exceed what is `available` (bytes; None: no limit)."""
    if available is None or need + draft_bytes <= available:
        return
    if draft_bytes:
        raise BudgetError(
            f"the {draft} draft's low-bit copies ({format_size(draft_bytes)}) with the KV caches and a "
            f"verify pass ({format_size(need)}) need {format_size(need + draft_bytes)}, {where} has "
            f"{format_size(available)}: draft with SelfDraft(bits=4) if it is 8, or offload the model with "
            f"a gpu_memory {format_size(need + draft_bytes - available)} smaller so the draft fits beside "
            "its weights (or raise cache_memory if the GPU has the room)", need + draft_bytes)
    raise BudgetError(
        f"the KV caches and a verify pass need {format_size(need)}, {where} has "
        f"{format_size(available)}: lower max_new_tokens, the tree's width or depth, or the model's "
        "gpu_memory", need)


def generation_bytes(model, draft_model, length: int, tree_tokens: int, vocab: int) -> int:
    """Bytes a generation allocates beside the weights: the model's (and a draft model's) KV cache of
    `length` positions, and the verify pass's logits (tree tokens x vocab, in the model's dtype and in
    float32 for acceptance)."""
    need = kv_bytes(model.config, length, model.dtype)
    if draft_model is not None:
        need += kv_bytes(draft_model.config, length, draft_model.dtype)
    return need + tree_tokens * vocab * (model.dtype.itemsize + 2 * torch.float32.itemsize)


def _neutral(value) -> bool:
    """Unset, or empty: a logits setting that changes nothing."""
    return value is None or (isinstance(value, (list, tuple, dict)) and not value)


# generation_config settings that change which token transformers' generate picks and that speculative
# generation does not apply: name -> (what leaves the tokens as they are, for the message; its test)
UNAPPLIED_SETTINGS = {
    "repetition_penalty": ("1.0", lambda v: _neutral(v) or v == 1.0),
    "encoder_repetition_penalty": ("1.0", lambda v: _neutral(v) or v == 1.0),
    "no_repeat_ngram_size": ("0", lambda v: _neutral(v) or v <= 0),
    "encoder_no_repeat_ngram_size": ("0", lambda v: _neutral(v) or v <= 0),
    "bad_words_ids": ("None", _neutral),
    "sequence_bias": ("None", _neutral),
    "suppress_tokens": ("None", _neutral),
    "begin_suppress_tokens": ("None", _neutral),
    "forced_eos_token_id": ("None", _neutral),
    "guidance_scale": ("None", lambda v: _neutral(v) or v == 1),
    "remove_invalid_values": ("False", lambda v: v is not True),
    "watermarking_config": ("None", _neutral),
    "num_beams": ("1", lambda v: _neutral(v) or v <= 1),
}
# the same for the samplers transformers applies only with do_sample (temperature, top_k and top_p are
# generate's own arguments)
UNAPPLIED_SAMPLING_SETTINGS = {
    "min_p": ("None", _neutral),
    "top_h": ("None", _neutral),
    "typical_p": ("1.0", lambda v: _neutral(v) or v >= 1.0),
    "epsilon_cutoff": ("0.0", lambda v: _neutral(v) or not 0.0 < v < 1.0),
    "eta_cutoff": ("0.0", lambda v: _neutral(v) or not 0.0 < v < 1.0),
}


def unapplied_settings(generation_config, prompt: int, stops: bool, do_sample: bool) -> dict[str, tuple]:
    """The settings of `generation_config` (a transformers GenerationConfig, or None) that would change
    the tokens of transformers' generate and that speculative generation does not apply: name -> (its
    value, the value that leaves the tokens as they are). prompt: the prompt's tokens (min_length counts
    them; forced_bos_token_id acts after one token only); stops: whether the generation has a stop token
    (min_length, min_new_tokens and exponential_decay_length_penalty act on it alone)."""
    if generation_config is None:
        return {}
    found = {}
    table = UNAPPLIED_SETTINGS | (UNAPPLIED_SAMPLING_SETTINGS if do_sample else {})
    for name, (default, neutral) in table.items():
        value = getattr(generation_config, name, None)
        if not neutral(value):
            found[name] = (value, default)
    forced_bos = getattr(generation_config, "forced_bos_token_id", None)
    if forced_bos is not None and prompt == 1:  # transformers forces it after a one-token prompt only
        found["forced_bos_token_id"] = (forced_bos, "None")
    if stops:  # these only hold the stop tokens back or push them forward
        for name, floor in (("min_new_tokens", 0), ("min_length", prompt)):
            value = getattr(generation_config, name, None)
            if value is not None and value > floor:
                found[name] = (value, "None")
        decay = getattr(generation_config, "exponential_decay_length_penalty", None)
        if decay is not None:
            found["exponential_decay_length_penalty"] = (decay, "None")
    return found


def check_generation_config(generation_config, prompt: int, stops: bool, do_sample: bool,
                            remedy: str | None = None) -> None:
    """ArgumentError naming every setting of `generation_config` that would change transformers'
    tokens and that speculative generation does not apply (`unapplied_settings`), each with its value.
    remedy: what to change, where the default (`model.generate()`, or the model's generation_config set
    to the neutral values) does not fit the caller."""
    found = unapplied_settings(generation_config, prompt, stops, do_sample)
    if not found:
        return
    given = ", ".join(f"{name}={value!r}" for name, (value, _) in found.items())
    reset = "; ".join(f"model.generation_config.{name} = {default}" for name, (_, default) in found.items())
    it = "them" if len(found) > 1 else "it"
    remedy = remedy or f"generate with model.generate(), or set {reset} to generate without {it}"
    raise ArgumentError(
        f"the model's generation_config sets {given}: transformers' generate applies {it} and speculative "
        "generation (a static KV cache and tree verification) does not, so the tokens would differ; "
        f"{remedy}")


def check_sampling(do_sample: bool, temperature, top_k, top_p) -> None:
    """ArgumentError for a temperature (with do_sample), top_k or top_p that transformers' generate would
    refuse: temperature a number above 0, top_k an integer of at least 0 (0: no top-k, as
    transformers), top_p a number in [0, 1]."""
    if do_sample and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                      or not temperature > 0 or not math.isfinite(temperature)):
        raise ArgumentError(f"temperature={temperature!r}: sample at a temperature above 0, or "
                            "do_sample=False")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ArgumentError(f"top_k={top_k!r}: give the number of most likely tokens to sample from, an "
                            "integer of at least 1 (0 or None: no top-k)")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0.0 <= top_p <= 1.0):
        raise ArgumentError(f"top_p={top_p!r}: give the probability mass to sample from, a number in "
                            "[0, 1] (1 or None: no top-p)")


def _rope_parameters(config) -> list[dict]:
    """The rotary settings of `config` (transformers 5's `rope_parameters`, else `rope_scaling`), one dict
    per layer type where they are given per layer type."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict):
        return []
    nested = [value for value in rope.values() if isinstance(value, dict)]
    return nested or [rope]


def _uses_alibi(config) -> bool:
    """Whether `config` is of a model that adds ALiBi biases to its attention scores (BLOOM; Falcon and
    MPT where they say so)."""
    attn = getattr(config, "attn_config", None)
    attn_alibi = attn.get("alibi") if isinstance(attn, dict) else getattr(attn, "alibi", False)
    return (getattr(config, "model_type", None) == "bloom" or getattr(config, "alibi", False) is True
            or attn_alibi is True or getattr(config, "position_embedding_type", None) == "alibi")


def check_positions(model, prompt: int, positions: int, tree: bool) -> None:
    """ArgumentError for a model whose positions speculative generation cannot give as transformers'
    generate does: local attention layers that find their window from the cache's last slots (GPT-Neo);
    ALiBi biases indexed by cache slot, with a tree (`tree`: a pass verifies more than one token; one
    token a pass writes each token at the slot of its position); LongRoPE factors that switch from short
    to long at `original_max_position_embeddings` within the generation (a prompt of `prompt` tokens
    reaching position `positions`), where transformers' generate computes the whole cache again."""
    config = model.config
    name = type(model).__name__
    layers = getattr(config, "attention_layers", None) or ()
    if "local" in layers:
        raise ArgumentError(
            f"the model ({name}) has local attention layers (attention_layers {list(layers)}) that cut their "
            "window from the last slots of the KV cache, not from the tokens' positions: speculative "
            "generation over a static cache would change its tokens; generate with model.generate() instead")
    if tree and _uses_alibi(config):
        raise ArgumentError(
            f"the model ({name}) adds ALiBi attention biases by cache slot, and a drafted tree's tokens sit "
            "at slots other than their positions: verifying a tree would change its tokens; generate with "
            "draft=None (one token a pass) or with model.generate() instead")
    for rope in _rope_parameters(config):
        if rope.get("rope_type", rope.get("type")) != "longrope":
            continue
        switch = rope.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None)
        if switch is not None and prompt <= switch < positions:
            raise ArgumentError(
                f"the model ({name}) scales its rotary embedding with LongRoPE, whose factors switch at "
                f"{switch} positions (original_max_position_embeddings), and this generation crosses it "
                f"(a prompt of {prompt} tokens reaching position {positions}): transformers' generate then "
                "computes the whole KV cache again with the long factors, which speculative generation "
                f"does not; keep the prompt, max_new_tokens and the tree's depth within {switch} positions "
                f"together, give a prompt longer than {switch} tokens, or generate with model.generate()")
