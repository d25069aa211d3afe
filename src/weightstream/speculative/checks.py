"""What `generate` refuses before it runs a forward, each with the change that fixes it."""

from __future__ import annotations

import inspect
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
