"""`weightstream probe`: measure what the planner needs to know about this machine, and cache it.

Three rates, as seconds per weight byte so the cost model can work in bytes:
- host->GPU copy from pinned memory;
- a GEMM whose weight is resident, at several tokens per forward (M);
- the same GEMM reading its weight in place from pinned host memory (zero copy), at the same M.
Cached per GPU model in $XDG_CACHE_HOME/weightstream (default ~/.cache/weightstream).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

TOKENS = (1, 16, 64, 256, 1024, 2048, 8192)


@dataclass(frozen=True)
class MachineProfile:
    """Measured rates of one GPU and its link. `resident` and `uva` map tokens per forward (M) to
    seconds per weight byte of a bf16 GEMM; `copy_s_per_byte` is the pinned host->GPU copy."""

    gpu: str
    copy_s_per_byte: float
    resident: dict[int, float]
    uva: dict[int, float]
    block_overhead_s: float = 0.0  # fixed cost of a block's small kernels (launch gaps, norms)

    @property
    def h2d_GBps(self) -> float:
        return 1e-9 / self.copy_s_per_byte

    def copy_seconds(self, nbytes: int) -> float:
        """Seconds to copy nbytes host->GPU."""
        return nbytes * self.copy_s_per_byte

    def resident_seconds(self, nbytes: int, tokens: int) -> float:
        """Seconds for GEMMs over nbytes of resident weights at `tokens` tokens per forward."""
        return nbytes * _interpolate(self.resident, tokens) + self.block_overhead_s

    def uva_seconds(self, nbytes: int, tokens: int) -> float:
        """Seconds for the same GEMMs reading their weights in place over the link."""
        return nbytes * _interpolate(self.uva, tokens) + self.block_overhead_s

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> MachineProfile:
        data = json.loads(text)
        for key in ("resident", "uva"):
            data[key] = {int(m): v for m, v in data[key].items()}
        return cls(**data)


def _interpolate(table: dict[int, float], tokens: int) -> float:
    """Seconds per byte at `tokens`, interpolating linearly in log(tokens) between measured points and
    extrapolating linearly in tokens past the largest (compute-bound: time grows with M)."""
    points = sorted(table.items())
    tokens = max(tokens, points[0][0])
    if tokens >= points[-1][0]:
        m, v = points[-1]
        return v * tokens / m
    for (m0, v0), (m1, v1) in zip(points, points[1:], strict=False):
        if m0 <= tokens <= m1:
            w = (math.log(tokens) - math.log(m0)) / (math.log(m1) - math.log(m0))
            return v0 + w * (v1 - v0)
    raise AssertionError("unreachable")


# Measured on an H200 (PCIe Gen5, torch 2.11) by `measure()`, recorded in
# benchmarks/results/plan_llama-3-8b.json; used to plan where no GPU can be measured (the CPU backend,
# `weightstream plan` on a machine without CUDA).
H200 = MachineProfile(
    gpu="NVIDIA H200 (reference, benchmarks/results/plan_llama-3-8b.json)",
    copy_s_per_byte=1.81937e-11,
    resident={1: 4.029e-13, 16: 5.116e-13, 64: 4.783e-13, 256: 4.697e-13, 1024: 1.433e-12,
              2048: 2.966e-12, 8192: 1.075e-11},
    uva={1: 2.067e-11, 16: 1.989e-11, 64: 2.097e-11, 256: 4.03e-11, 1024: 8.062e-11, 2048: 1.604e-10,
         8192: 7.65e-10},
)


def cuda_times_ms(fn, reps: int, warmup: int = 3) -> list[float]:
    """Milliseconds of each of `reps` calls of `fn` after `warmup` calls, timed with CUDA events on the
    current stream, each call started from an idle GPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def _time_ms(fn, reps: int = 10) -> float:
    return statistics.median(cuda_times_ms(fn, reps))


def measure(device: torch.device | str = "cuda", progress: bool = True) -> MachineProfile:
    """Measure this GPU: pinned copy bandwidth and bf16 GEMM time per weight byte, resident and zero
    copy, at each M in TOKENS. Takes about ten seconds."""
    from .uva import uva_view

    device = torch.device(device)
    copy_s_per_byte = copy_seconds_per_byte(device)
    n, k = 8192, 8192  # a 128 MiB bf16 weight, the size of a large projection
    weight = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    host = torch.empty(n * k * 2, dtype=torch.uint8, pin_memory=True)
    host.copy_(weight.view(-1).view(torch.uint8))
    remote = uva_view(host, device).view(torch.bfloat16).view(n, k)
    resident, uva = {}, {}
    for m in TOKENS:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        resident[m] = _time_ms(lambda x=x: x @ weight.t()) / 1e3 / (n * k * 2)
        uva[m] = _time_ms(lambda x=x: x @ remote.t(), reps=3) / 1e3 / (n * k * 2)
        if progress:
            print(f"  M={m:5d}: resident {1e-9 / resident[m]:8.1f} GB/s of weights, zero copy "
                  f"{1e-9 / uva[m]:6.1f} GB/s", flush=True)
    return MachineProfile(torch.cuda.get_device_name(device), copy_s_per_byte, resident, uva)


def copy_seconds_per_byte(device: torch.device, nbytes: int = 2**30) -> float:
    """Pinned host->GPU copy time per byte (median of 10 copies of 1 GiB)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return _time_ms(lambda: dst.copy_(src, non_blocking=True)) / 1e3 / nbytes


def cache_path(gpu: str) -> Path:
    """Where the profile of GPU model `gpu` is cached."""
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "weightstream"
    return root / ("profile-" + "".join(c if c.isalnum() else "_" for c in gpu) + ".json")


def load_profile(device: torch.device | str | None = None, refresh: bool = False) -> MachineProfile:
    """This GPU's profile from the cache, measured (and cached) when absent or when `refresh`. Without
    CUDA, the reference H200 profile."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return H200
    path = cache_path(torch.cuda.get_device_name(device))
    if path.is_file() and not refresh:
        return MachineProfile.from_json(path.read_text())
    print(f"weightstream: measuring this GPU for the planner (about ten seconds, once; cached in {path})",
          file=sys.stderr, flush=True)
    profile = measure(device, progress=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.to_json())
    return profile
