"""Why a compiled, offloaded Flux transformer can differ from its compiled resident self in bf16.

docs/exactness.md names one cause: Inductor fuses an op at the end of one block with the start of the
next in the resident graph, and weightstream's ops sit on that edge, so the offloaded graph cannot
fuse there. This separates that cause from others, at Flux.1-dev's width and its 1024x1024 token count
(4096 image + 512 text tokens), with fewer blocks so each compile takes seconds, not minutes:

  - eager: resident, resident with the (idle) ops on every block edge (also with its weights
    packed, below), offloaded raw, offloaded compressed: all must be equal;
  - compiled (fullgraph, `emulate_precision_casts` on): the same, each compared with the resident
    model (what users see), with the resident model with the ops on the same edges (the same graph,
    fused the same way) and with that model's weights packed into one buffer per block at a slot's
    offsets ("packed": where the weights live, as offloaded). Equal to the second and not to the
    first means the difference is the fusion edge; equal to the third only, where the weights live.
    Two controls: the resident model with the ops compiled a second time ("again": the same graph
    and the same weights, so any difference is compile-to-compile variation), and each compiled
    function's second call against its first (run-to-run). `--no-cache` turns Inductor's FX-graph
    and autotuning caches off, so "again" really compiles and benchmarks anew.

Every block streams through two slots (a forced placement, so no profile decides it).

    PYTHONPATH=src:tests python3 benchmarks/diag_flux_compile.py --out DIR             # H200
    PYTHONPATH=src:tests python3 benchmarks/diag_flux_compile.py --out DIR --no-cache  # controls
    PYTHONPATH=src:tests python3 benchmarks/diag_flux_compile.py --out DIR --tiny      # CPU smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from conftest import with_boundaries

import weightstream as ws
from weightstream.bench.diffusion import FLUX_DEV, TINY_FLUX, Diffusion
from weightstream.bench.phases import Phase
from weightstream.placement.plan import placement_of
from weightstream.placement.prepare import prepare


def packed(model):
    """`model` (resident) with each block's parameters and buffers moved into one buffer per block, at
    the aligned offsets a slot would give them (`layout.pack`): the weights' memory laid out as
    offloaded, each block in memory of its own (slots are shared by blocks two apart)."""
    from weightstream.engine.layout import pack
    from weightstream.placement.blocks import find_blocks

    for block in find_blocks(model):
        tensors = [*block.module.parameters(), *block.module.buffers()]
        slices, total = pack([t.numel() * t.element_size() for t in tensors])
        buffer = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
        for t, piece in zip(tensors, slices, strict=True):
            view = buffer[piece.offset: piece.offset + piece.nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            t.data = view
    return model


def offloaded(model, device: torch.device, compress: bool):
    """`model` offloaded with every block streamed through two slots (compressed: with a landing buffer
    per slot)."""
    cost = prepare(model, gpu_memory=2**40, device=device, compress=compress).cost
    blocks = tuple(range(len(cost.block_bytes)))
    # None where no group would shrink (the tiny config): then it streams raw, and the log says so
    placement = placement_of(cost, blocks, 2, compressed=compress) or placement_of(cost, blocks, 2)
    return ws.offload(model, gpu_memory=placement.gpu_bytes, device=device, placement=placement,
                      compress=compress)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--double", type=int, default=2, help="double-stream blocks (Flux.1-dev: 19)")
    parser.add_argument("--single", type=int, default=4, help="single-stream blocks (Flux.1-dev: 38)")
    parser.add_argument("--tiny", action="store_true", help="the tiny Flux config on the CPU (a smoke run)")
    parser.add_argument("--no-cache", action="store_true",
                        help="Inductor's FX-graph and autotune caches off (every compile starts afresh)")
    parser.add_argument("--deterministic", action="store_true",
                        help="Inductor's deterministic mode: no on-device benchmarking of kernel configs "
                             "that changes numerics (torch._inductor.config.deterministic)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.tiny else "cuda")
    fields = dict(TINY_FLUX if args.tiny else FLUX_DEV, num_layers=args.double, num_single_layers=args.single)
    torch._inductor.config.emulate_precision_casts = True
    if args.deterministic:
        torch._inductor.config.deterministic = True
    if args.no_cache:
        torch._inductor.config.fx_graph_cache = False
        torch._inductor.config.autotune_local_cache = False
    kind = Diffusion(fields)
    ref = kind.build(fields, device, seed=0)
    image, text = fields["input_image_tokens"], fields["input_text_tokens"]
    x = kind.inputs(ref, [Phase("denoise-b1", 1, image + text)], device, seed=0)["denoise-b1"]
    models = {"resident": ref, "resident+ops": with_boundaries(copy.deepcopy(ref)),
              "resident+ops packed": with_boundaries(packed(copy.deepcopy(ref)))}
    handles = {}
    for name, compress in (("offloaded raw", False), ("offloaded compressed", True)):
        models[name] = copy.deepcopy(ref)
        handles[name] = offloaded(models[name], device, compress)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    lines = [f"# {' '.join(sys.argv)}", f"# {gpu}, torch {torch.__version__}; {args.double} double + "
             f"{args.single} single blocks, {image} + {text} tokens, bf16; Inductor deterministic "
             f"{torch._inductor.config.deterministic}; caches {'off' if args.no_cache else 'on'}"]
    doc = {}
    for name, handle in handles.items():
        s = handle.stats
        lines.append(f"{name}: {s.groups} groups through {s.slots} slots, wire {s.wire_bytes / 1e6:.1f} "
                     f"MB of {s.wire_raw_bytes / 1e6:.1f} MB")
    outputs = {}
    with torch.no_grad():
        for name, model in models.items():
            outputs[("eager", name)] = kind.forward(model, x).clone()
        compiles = [*models.items(), ("resident+ops again", models["resident+ops"])]
        for name, model in compiles:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            start = time.perf_counter()
            fn = torch.compile(lambda x, model=model: kind.forward(model, x), fullgraph=True)
            first = fn(x).clone()
            outputs[("compiled", name)] = fn(x).clone()
            breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
            rerun = torch.equal(first, outputs[("compiled", name)])
            lines.append(f"compiled {name}: {time.perf_counter() - start:.1f} s, {breaks} graph breaks, "
                         f"second call equal to the first {rerun}")
            doc[f"graph_breaks {name}"] = breaks
            doc[f"compiled: {name} run to run"] = rerun

    def diff(a, b):
        return (outputs[a].float() - outputs[b].float()).abs().max().item()

    for mode in ("eager", "compiled"):
        names = ["resident+ops", "resident+ops packed", "offloaded raw", "offloaded compressed"]
        for name in names + (["resident+ops again"] if mode == "compiled" else []):
            for against in ("resident", "resident+ops", "resident+ops packed"):
                if name == against or (name, against) == ("resident+ops", "resident+ops packed"):
                    continue
                equal = torch.equal(outputs[(mode, name)], outputs[(mode, against)])
                doc[f"{mode}: {name} == {against}"] = equal
                lines.append(f"{mode}: {name} vs {against}: equal {equal} (max abs diff "
                             f"{diff((mode, name), (mode, against)):.3g})")
    for handle in handles.values():
        handle.restore()
    text_out = "\n".join(lines)
    print(text_out)
    stem = "diag_flux_compile" + ("_deterministic" if args.deterministic else "")
    stem += "_nocache" if args.no_cache else ""
    stem += "_tiny" if args.tiny else ""
    (out / f"{stem}.log").write_text(text_out + "\n")
    doc = dict(command=" ".join(sys.argv), deterministic=args.deterministic, no_cache=args.no_cache, **doc)
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
