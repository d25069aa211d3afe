"""Benchmark of compressed streaming (issue 14): raw vs compress=True on a Llama shape, HF-initialized bf16.

For each budget (every decoder layer streamed; 25% of the weights) and each wire format (raw,
compressed), one forward `model(ids, use_cache=False).logits` per phase: batch-1 decode (eager, and
replayed from a CUDA graph of the eager forward; --compiled adds torch.compile + CUDA graph, with
Inductor's emulate_precision_casts on for every model, docs/exactness.md says why),
batch-64 decode and 2048-token prefill (eager). Times are CUDA-event medians after warm-up
(timing.py); every output is checked with torch.equal against the resident model run the same way.
Reports the wire ratio, the decoder's throughput (standalone kernel timing, GB/s of decoded bytes)
and each time against the raw link bound (raw streamed bytes / measured link bandwidth).

    PYTHONPATH=src python3 benchmarks/bench_codec.py --out benchmarks/results/codec_llama-3-8b
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import weightstream as ws
from weightstream.engine.layout import pack
from weightstream.placement.blocks import find_blocks
from weightstream.placement.probe import copy_seconds_per_byte
from weightstream.placement.shapes import SHAPES
from weightstream.placement.timing import capture_graph, time_calls
from weightstream.wire import codec

PHASES = {"decode-b1": (1, 1), "decode-b64": (64, 1), "prefill-2048": (1, 2048)}


def log(line: str, sink) -> None:
    print(line, flush=True)
    sink.write(line + "\n")
    sink.flush()


def build(shape: str, layers: int | None, device: torch.device) -> nn.Module:
    """The shape with Hugging Face's own initialization (normal, std 0.02) in bf16, on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(SHAPES[shape])
    if layers:
        fields["num_hidden_layers"] = layers
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval().requires_grad_(False)


def sizes(model: nn.Module) -> tuple[int, int, int]:
    """(bytes outside the decoder layers, one layer's slot bytes, all weight bytes)."""
    layers = [b.module for b in find_blocks(model)]
    inside = {id(t) for layer in layers for t in [*layer.parameters(), *layer.buffers()]}
    everything = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    fixed = sum(t.numel() * t.element_size() for i, t in everything.items() if i not in inside)
    slot = pack([t.numel() * t.element_size() for t in [*layers[0].parameters(), *layers[0].buffers()]])[1]
    return fixed, slot, sum(t.numel() * t.element_size() for t in everything.values())


def median_ms(fn, reps: int, warmup: int) -> tuple[float, torch.Tensor]:
    """Median CUDA-event ms of `reps` calls after `warmup`, and a copy of the last output."""
    for _ in range(warmup):
        fn()
    times, out = time_calls(fn, reps, torch.device("cuda"))
    return statistics.median(times), out.clone() if isinstance(out, torch.Tensor) else out


def run_phases(model: nn.Module, inputs: dict, reps: int, compiled: bool, graphs: bool = True) -> dict:
    """{(phase, mode): (median ms, output)} for one model."""
    results = {}
    with torch.no_grad():
        for phase, ids in inputs.items():
            fwd = lambda x: model(x, use_cache=False).logits  # noqa: E731
            n = reps if phase.startswith("decode") else max(3, reps // 2)
            results[(phase, "eager")] = median_ms(lambda ids=ids, fwd=fwd: fwd(ids), n, 2)
            if phase == "decode-b1" and graphs:
                replay = capture_graph(fwd, ids)
                results[(phase, "graph")] = median_ms(replay, reps, 2)
                del replay
                if compiled:
                    cfwd = torch.compile(fwd, fullgraph=True)
                    replay = capture_graph(cfwd, ids)
                    results[(phase, "compiled+graph")] = median_ms(replay, reps, 2)
                    del replay
            torch.cuda.synchronize()
    return results


def decoder_rate(handle, device: torch.device) -> float:
    """GB/s of decoded bytes of one real compressed group (standalone kernel launches)."""
    from weightstream.wire import triton_decoder as codec_triton

    enc = next((e for e in handle._wire if e is not None), None)
    if enc is None:
        return 0.0
    blob = enc.blob.to(device)
    out = torch.empty(enc.raw_bytes, dtype=torch.uint8, device=device)
    ms, _ = median_ms(lambda: codec_triton.decode(blob, out, enc.chunks), 20, 3)
    return enc.raw_bytes / (ms / 1e3) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=0, help="override the layer count (smoke runs)")
    parser.add_argument("--out", required=True, help="folder for codec_<shape>.json and .log")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--budgets", default="25,all",
                        help="comma list: percentages of the weights, or all (the budget at which "
                             "compressed streaming streams every layer through two slots)")
    parser.add_argument("--compiled", action="store_true", help="also torch.compile + CUDA graph (slow)")
    parser.add_argument("--eager", action="store_true", help="eager only (no CUDA graph)")
    args = parser.parse_args()
    if args.compiled:  # compiled bf16 is bit-identical only with Inductor rounding as eager does
        torch._inductor.config.emulate_precision_casts = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"codec_{args.shape}" + (f"_{args.layers}l" if args.layers else "")
    sink = open(out / f"{name}.log", "w")
    device = torch.device("cuda")
    t0 = time.perf_counter()
    log(f"# {' '.join(sys.argv)}", sink)
    log(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}", sink)
    bandwidth = 1e-9 / copy_seconds_per_byte(device)
    log(f"link: {bandwidth:.1f} GB/s host->GPU (pinned, 1 GiB copies)", sink)
    ref = build(args.shape, args.layers, device)
    fixed, slot, total = sizes(ref)
    gen = torch.Generator().manual_seed(1)
    inputs = {p: torch.randint(ref.config.vocab_size, shape, generator=gen).to(device)
              for p, shape in PHASES.items()}
    resident = run_phases(ref, inputs, args.reps, args.compiled, not args.eager)
    rows = []
    for (phase, mode), (ms, _) in resident.items():
        rows.append(dict(budget="resident", wire="-", phase=phase, mode=mode, ms=ms, exact=True))
        log(f"resident {phase:13s} {mode:15s} {ms:9.2f} ms", sink)
    # a second copy for the offloaded runs if it fits beside the resident model (8B); else (32B,
    # Mixtral) the resident model goes and each run builds its own, identical one (same seed)
    keep = torch.cuda.mem_get_info(device)[0] > total + (16 << 30)
    if not keep:
        del ref
        gc.collect()
        torch.cuda.empty_cache()
        ref = None
        log("# the resident model is dropped after its runs; each offloaded run builds the same weights "
            "again (seed 0); restore is checked only when both fit", sink)
    enc_rate = []
    for budget in args.budgets.split(","):
        raw_link_ms = None
        for compress in (False, True):  # raw first: its streamed bytes give the raw link bound
            model = copy.deepcopy(ref) if keep else build(args.shape, args.layers, device)
            if budget == "all":  # the budget at which compressed streaming streams every layer whole
                gpu_memory = fixed + 2 * (slot + int(0.72 * 1.01 * slot)) + (1 << 20)
            else:
                gpu_memory = int(total * int(budget) / 100)
            start = time.perf_counter()
            handle = ws.offload(model, gpu_memory=gpu_memory, strategy="stream", compress=compress)
            torch.cuda.synchronize()
            offload_s = time.perf_counter() - start
            stats = handle.stats
            if compress:
                enc_rate.append(stats.wire_raw_bytes / offload_s / 1e9)
            # the raw link bound at this budget: what raw streaming moves per forward / link bandwidth
            own_ms = stats.wire_raw_bytes / (bandwidth * 1e9) * 1e3
            raw_link_ms = raw_link_ms or own_ms
            link_ms = raw_link_ms
            p = handle.placement
            label = f"{budget}{'%' if budget != 'all' else ''} {'compressed' if compress else 'raw'}"
            log(f"{label}: budget {gpu_memory / 1e9:.2f} GB: {stats.groups} groups streamed through "
                f"{p.n_slots} slots{f' (each block its {p.part} largest tensors)' if p.part else ''}, "
                f"wire {stats.wire_bytes / 1e9:.2f} GB of {stats.wire_raw_bytes / 1e9:.2f} GB (ratio "
                f"{stats.wire_ratio:.4f}), staging {stats.staging_bytes / 1e9:.2f} GB, offload() "
                f"{offload_s:.1f} s; raw link bound {link_ms:.1f} ms, this placement's raw bytes "
                f"{own_ms:.1f} ms; predicted {p.prediction.ms:.1f} ms (tokens=1)", sink)
            rate = decoder_rate(handle, device) if compress else None
            if rate:
                log(f"  decoder: {rate:.0f} GB/s of decoded bytes (one layer, standalone)", sink)
            runs = run_phases(model, inputs, args.reps, args.compiled, not args.eager)
            for (phase, mode), (ms, got) in runs.items():
                exact = torch.equal(got, resident[(phase, mode)][1])
                rows.append(dict(budget=budget, wire="compressed" if compress else "raw", phase=phase,
                                 mode=mode, ms=ms, exact=exact, link_bound_ms=link_ms,
                                 vs_raw_link=ms / link_ms, wire_ratio=stats.wire_ratio,
                                 groups=stats.groups, staging_bytes=stats.staging_bytes,
                                 decoder_GBps=rate, offload_s=offload_s, misses=handle.stats.misses))
                log(f"  {phase:13s} {mode:15s} {ms:9.2f} ms  {ms / link_ms:6.3f}x raw link bound  "
                    f"exact={exact}", sink)
            handle.restore()
            if keep:
                restored = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                                  ref.state_dict().values(), strict=True))
                log(f"  restore exact: {restored}", sink)
                rows.append(dict(budget=budget, wire="compressed" if compress else "raw", phase="restore",
                                 mode="-", ms=None, exact=restored))
            del model, handle
            gc.collect()
            torch.cuda.empty_cache()
    result = dict(shape=args.shape, layers=args.layers or None, gpu=torch.cuda.get_device_name(device),
                  torch=torch.__version__, link_GBps=bandwidth, chunk=codec.CHUNK,
                  gpu_encode_GBps=enc_rate, rows=rows, command=" ".join(sys.argv),
                  seconds=time.perf_counter() - t0)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    log(f"# done in {result['seconds']:.0f} s; all exact: {all(r['exact'] for r in rows)}", sink)


if __name__ == "__main__":
    main()
