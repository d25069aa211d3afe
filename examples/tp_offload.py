"""Tensor parallelism + offloading: each rank shards a Llama-shaped model with PyTorch's own
`torch.distributed.tensor.parallel`, then offloads its shard with weightstream, so each rank streams
only its shard over its own host link. Random weights (built from a config, never downloaded).

    torchrun --nproc_per_node 2 examples/tp_offload.py                  # one GPU per rank (NCCL)
    torchrun --nproc_per_node 2 examples/tp_offload.py --device cpu     # CPU ranks (gloo), a tiny model

Each rank prints its placement and whether its output equals the same TP model fully resident.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist

import weightstream as ws


def tp_plan(n_layers: int) -> dict:
    """Megatron-style MLP sharding: gate/up column-parallel, down row-parallel (attention replicated)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        plan.update({p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                     p + "mlp.down_proj": RowwiseParallel()})
    return plan


def need_what_it_takes(device: str) -> bool:
    """Check, before any process group starts, what this run needs: torchrun's environment, and for
    --device cuda a CUDA GPU per rank on this host; say what is missing and the way out."""
    world = os.environ.get("WORLD_SIZE")
    if world is None:
        print("run under torchrun, which starts the ranks: torchrun --nproc_per_node 2 "
              "examples/tp_offload.py [--device cpu]")
        return False
    if device not in ("cuda", "cpu"):
        print(f"--device {device}: give cuda (one GPU per rank) or cpu (gloo ranks, a tiny model)")
        return False
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if device == "cuda" and torch.cuda.device_count() < local:
        print(f"--device cuda runs one GPU per rank: {local} ranks on this host, {torch.cuda.device_count()} "
              "CUDA GPUs; start fewer ranks, or run with --device cpu")
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--fraction", type=float, default=0.25, help="GPU budget per rank, of its shard's bytes")
    args = ap.parse_args()
    if not need_what_it_takes(args.device):
        raise SystemExit(2)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import AutoModelForCausalLM, LlamaConfig

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    size = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8) if cuda else \
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4)
    config = LlamaConfig(vocab_size=32000 if cuda else 128, num_attention_heads=32 if cuda else 4,
                         num_key_value_heads=8 if cuda else 2, **size)
    torch.manual_seed(0)  # every rank builds the same weights before sharding
    with torch.device(device):
        ref = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if cuda else torch.float32)
    ref = ref.eval().requires_grad_(False)
    parallelize_module(ref, init_device_mesh(device.type, (world,)), tp_plan(config.num_hidden_layers))
    model = copy.deepcopy(ref)
    shard = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in model.parameters())
    handle = ws.offload(model, gpu_memory=int(shard * args.fraction), device=device)
    ids = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        exact = torch.equal(model(ids).logits, ref(ids).logits)
    print(f"rank {rank}/{world}: {handle.stats}; output equals the resident TP model: {exact}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
