"""Quantized weights streamed as they are: Llama-3-8B shape, batch-1 decode, against the link bound.

For each variant of the same random Llama-3-8B-shaped model (bf16 weights; decoder linears in fp8
float8_e4m3fn with 128x128 float32 `weight_scale_inv`, as transformers' fine-grained FP8 lays it out,
run through `weightstream.formats.fp8.Fp8Linear`; torchao int4 weight-only, tinygemm-packed, group 128, when
torchao runs here):
1. the resident model's one-token logits (the reference);
2. `ws.offload(strategy="stream", tokens=1)` at 25% of the variant's stored bytes, or, where that
   cannot hold what must stay resident plus two slots of one layer, the smallest budget that can
   (both recorded);
3. one-token forward, eager, no KV cache: median ms of CUDA-event timings (`weightstream.placement.timing`),
   exactness (`torch.equal`) against the resident logits, and the link bound = streamed bytes / the
   pinned host->GPU rate measured in the same run.
Writes quant_llama-3-8b.json and quant_llama-3-8b.log into the output folder. About 2-3 minutes on an
H200.

Run: PYTHONPATH=src python3 benchmarks/bench_quant.py OUT_DIR [--variants bf16,fp8,int4] [--reps 10]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

import weightstream as ws
from weightstream.engine.layout import align_up
from weightstream.formats import fp8
from weightstream.placement.blocks import find_blocks
from weightstream.placement.entries import _collect
from weightstream.placement.probe import copy_seconds_per_byte
from weightstream.placement.shapes import SHAPES
from weightstream.placement.timing import time_calls

_LOG: list[str] = []


def log(msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    _LOG.append(line)


def build(device: torch.device, seed: int = 0) -> nn.Module:
    """Llama-3-8B shape with random bf16 weights, born on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(SHAPES["llama-3-8b"])
    fields.pop("model_type")
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = LlamaForCausalLM(LlamaConfig(**fields, attn_implementation="sdpa"))
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def decoder_linear(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear) and ".layers." in f".{fqn}"


def quantize(model: nn.Module, variant: str) -> nn.Module:
    """The model in `variant`: bf16 as built, fp8 (Fp8Linear, 128x128 block scales; embeddings and LM
    head stay bf16 as in transformers' FP8 checkpoints) or torchao int4 weight-only (decoder linears)."""
    if variant == "fp8":
        return fp8.quantize_model(model, (128, 128))
    if variant == "int4":
        from torchao.quantization import Int4WeightOnlyConfig, quantize_

        quantize_(model, Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d"),
                  filter_fn=decoder_linear)
    return model


def budget_for(model: nn.Module, fraction: float) -> dict:
    """`fraction` of the stored bytes, raised where needed to what stays resident plus two layer slots."""
    blocks = [b.module for b in find_blocks(model)]
    entries = _collect(model, blocks)
    total = sum(e.nbytes for e in entries)
    fixed = sum(e.nbytes for e in entries if e.owner is None)
    layer = max(sum(align_up(e.nbytes) for e in entries if e.owner == i) for i in range(len(blocks)))
    floor = fixed + 2 * layer + 2**20
    budget = max(int(total * fraction), floor)
    return {"stored_bytes": total, "fixed_bytes": fixed, "layer_bytes": layer, "budget_bytes": budget,
            "budget_fraction": budget / total, "raised_to_two_slots": budget > int(total * fraction)}


def run_variant(variant: str, device: torch.device, fraction: float, reps: int,
                link_s_per_byte: float) -> dict:
    """Build, measure resident, offload, measure streamed; one result row (sizes in bytes, times in ms)."""
    t0 = time.perf_counter()
    model = quantize(build(device), variant)
    vocab = model.config.vocab_size
    ids = torch.randint(vocab, (1, 1), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits.clone()
        resident_ms = statistics.median(time_calls(lambda: model(ids, use_cache=False).logits, reps,
                                                   device)[0])
    budget = budget_for(model, fraction)
    raised = ", raised to fit two slots" if budget["raised_to_two_slots"] else ""
    log(f"{variant}: built in {time.perf_counter() - t0:.1f} s, "
        f"stored {budget['stored_bytes'] / 1e9:.2f} GB, resident decode {resident_ms:.2f} ms; "
        f"budget {budget['budget_bytes'] / 1e9:.2f} GB "
        f"({100 * budget['budget_fraction']:.1f}%{raised})")
    t0 = time.perf_counter()
    handle = ws.offload(model, gpu_memory=budget["budget_bytes"], device=device, strategy="stream", tokens=1)
    offload_s = time.perf_counter() - t0
    stats = handle.stats
    with torch.no_grad():
        times, out = time_calls(lambda: model(ids, use_cache=False).logits, reps + 2, device)
    times = times[2:]  # the first calls warm the allocator and the schedule's prologue
    exact = bool(torch.equal(out, reference))
    stats = handle.stats
    out_of_order = getattr(stats, "misses", getattr(stats, "fetches", None))  # the field's name changes
    median = statistics.median(times)
    bound = stats.streamed_bytes * link_s_per_byte * 1e3
    row = {
        "variant": variant, **budget, "offload_s": offload_s, "resident_decode_ms": resident_ms,
        "streamed_bytes": stats.streamed_bytes, "resident_bytes": stats.resident_bytes,
        "groups": stats.groups, "slots": stats.slots, "part": handle.placement.part,
        "predicted_ms": stats.predicted_ms, "decode_ms": median, "decode_min_ms": min(times),
        "decode_max_ms": max(times), "link_bound_ms": bound, "ratio_to_link_bound": median / bound,
        "exact": exact, "out_of_order": out_of_order, "times_ms": times,
    }
    log(f"{variant}: streamed {stats.streamed_bytes / 1e9:.2f} GB in {stats.groups} groups, "
        f"{stats.slots} slots; decode {median:.1f} ms (min {min(times):.1f}), link bound {bound:.1f} ms, "
        f"ratio {median / bound:.3f}; exact {exact}; out-of-order fetches {out_of_order}")
    handle.restore()  # frees the pinned arena; the model goes with this frame (main collects it)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="output folder for quant_llama-3-8b.json and .log")
    p.add_argument("--variants", default="bf16,fp8,int4")
    p.add_argument("--fraction", type=float, default=0.25, help="budget as a fraction of stored bytes")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_quant needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    args.out.mkdir(parents=True, exist_ok=True)
    link = copy_seconds_per_byte(device)
    log(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; pinned host->GPU "
        f"{1e-9 / link:.1f} GB/s")
    doc = {"shape": "llama-3-8b", "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
           "h2d_GBps": 1e-9 / link, "fraction": args.fraction, "reps": args.reps, "results": []}
    try:
        import torchao

        doc["torchao"] = torchao.__version__
    except ImportError:
        doc["torchao"] = None
    for variant in args.variants.split(","):
        try:
            doc["results"].append(run_variant(variant, device, args.fraction, args.reps, link))
        except Exception as err:  # one variant failing (torchao missing, a kernel absent) keeps the rest
            log(f"{variant}: FAILED {type(err).__name__}: {err}")
            doc["results"].append({"variant": variant, "error": f"{type(err).__name__}: {err}",
                                   "traceback": traceback.format_exc()[-3000:]})
        gc.collect()
        torch.cuda.empty_cache()
        (args.out / "quant_llama-3-8b.json").write_text(json.dumps(doc, indent=1))
        (args.out / "quant_llama-3-8b.log").write_text("\n".join(_LOG) + "\n")


if __name__ == "__main__":
    main()
