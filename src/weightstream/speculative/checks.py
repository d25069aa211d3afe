"""What `generate` refuses before it runs a forward, each with the change that fixes it."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ArgumentError, BudgetError
from ..sizes import format_size
from .cache import kv_bytes


def check_causal_lm(model, what: str = "model") -> int:
    """Raise ArgumentError unless `model` is a decoder-only causal LM with full attention; return its
    vocabulary size (the width of its logits)."""
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
    layer_types = getattr(config, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types):
        raise ArgumentError(
            f"the {what} ({type(model).__name__}) has layers of kinds {sorted(set(layer_types))}: "
            "speculative generation verifies trees over a full-attention KV cache only; generate with "
            "model.generate() instead")
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    if attention not in ("eager", "sdpa"):
        raise ArgumentError(
            f"the {what} attends with {attention!r}, which takes no 4-D tree mask: load it with "
            "attn_implementation='sdpa' (or 'eager') for speculative generation")
    return head.weight.shape[0]


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
