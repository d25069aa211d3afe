"""Speculative decoding for causal LMs, offloaded or resident: `generate(model, input_ids, draft=...)`.

A draft proposes a tree of tokens; the model verifies the whole tree in one forward and keeps the
longest path it agrees with, plus one token of its own. An offloaded forward bound by the link costs
about the same for one token as for a tree of many, so each accepted token saves a pass of streaming.

    tree.py           TreeShape (the static budget: width x depth), Tree, masks, positions, KV moves
    cache.py          TreeCache: a static KV cache written at chosen positions; kv_bytes
    verify.py         TreeForward: one forward over tokens at positions with a 4-D mask (compilable)
    acceptance.py     greedy walk, rejection sampling that keeps the model's distribution exactly
    draft.py          the Draft protocol; resolve_draft (what `draft=` may name)
    prompt_lookup.py  PromptLookup: n-gram matches in the context, no weights
    draft_model.py    DraftModel: a small causal LM with the same tokenizer, drafting a beam tree
    quantize.py       symmetric int8 / int4 weight-only quantization in groups (pure torch)
    self_draft.py     SelfDraft: the model's own resident modules plus low-bit copies of its off-GPU blocks
    shape_choice.py   the tree shape of the highest predicted tokens/ms under a stated acceptance model
    shape_costs.py    verify and draft-step ms from the placement's cost model; width="auto"
    budget.py         one gpu_memory split between the target's weights, staging and the draft's weights
    checks.py         what generate refuses, with the change that fixes it
    loop.py           generate(), Generation, GenerationStats
"""

from .budget import DraftSplit, offload_with_draft, plan_split
from .draft import Draft, NoDraft
from .draft_model import DraftModel
from .loop import Generation, GenerationStats, generate
from .prompt_lookup import PromptLookup
from .self_draft import SelfDraft
from .tree import Tree, TreeShape

__all__ = ["Draft", "DraftModel", "DraftSplit", "Generation", "GenerationStats", "NoDraft", "PromptLookup",
           "SelfDraft", "Tree", "TreeShape", "generate", "offload_with_draft", "plan_split"]
