"""Tensor parallelism composed with offloading: a model sharded with PyTorch's own
`torch.distributed.tensor.parallel` (DTensor parameters), then offloaded on each rank. Each rank
streams only its shard (the DTensor's local tensor flows through the slots, the DTensor is rebuilt
over slot memory), the collectives stay where PyTorch put them, and each rank's output equals the same
TP model resident. Two ranks with gloo on the CPU backend."""

from __future__ import annotations

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import make_model

import weightstream as ws

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tp_plan(model) -> dict:
    """Megatron-style MLP sharding of every decoder layer (column then row parallel)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}.mlp."
        plan.update({p + "gate_proj": ColwiseParallel(), p + "up_proj": ColwiseParallel(),
                     p + "down_proj": RowwiseParallel()})
    return plan


def _rank(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh("cpu", (WORLD,))
        ref = make_model("llama")
        unsharded_mlp = sum(p.numel() * p.element_size() for n, p in ref.named_parameters() if ".mlp." in n)
        parallelize_module(ref, mesh, tp_plan(ref))
        model = copy.deepcopy(ref)
        ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            want = [ref(ids).logits, ref(ids.flip(0)).logits]
        budget = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in model.parameters())
        handle = ws.offload(model, gpu_memory=int(budget * 0.6), device="cpu", strategy="stream")
        with torch.no_grad():
            got = [model(ids).logits, model(ids.flip(0)).logits]
        stats = handle.stats
        from torch.distributed.tensor import DTensor

        sharded = [e for g in handle.engine.groups for e, _ in g if isinstance(e.tensor, DTensor)]
        # what a rank moves for a sharded weight is its local shard, not the global tensor
        shard_bytes = all(e.nbytes == e.tensor.to_local().nbytes < e.tensor.numel() * e.tensor.element_size()
                          for e in sharded)
        handle.restore()
        with torch.no_grad():
            restored = model(ids).logits
        results[rank] = dict(exact=all(torch.equal(a, b) for a, b in zip(got, want, strict=True)),
                             restored=torch.equal(restored, want[0]), streamed=stats.streamed_bytes,
                             groups=stats.groups, unsharded_mlp=unsharded_mlp, misses=stats.misses,
                             sharded=len(sharded), shard_bytes=shard_bytes)
    except BaseException as exc:  # reported in the parent
        results[rank] = dict(error=f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
def test_tensor_parallel_ranks_stream_their_shards_exactly():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(_free_port(), results), nprocs=WORLD, join=True)
        results = dict(results)
    assert sorted(results) == list(range(WORLD))
    for rank, r in results.items():
        assert "error" not in r, f"rank {rank}: {r.get('error')}"
        assert r["exact"] and r["restored"] and r["misses"] == 0 and r["groups"] >= 2
        # a rank streams at most its shard: the MLP weights split WORLD ways, plus attention and norms
        assert r["streamed"] < r["unsharded_mlp"]
        assert r["sharded"] >= 3 and r["shard_bytes"]
