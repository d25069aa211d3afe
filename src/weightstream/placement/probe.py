"""`weightstream probe`: measure what the planner needs to know about this machine, and cache it.

Three rates, as seconds per weight byte so the cost model can work in bytes:
- host->GPU copy from pinned memory;
- a GEMM whose weight is resident, at several tokens per forward (M);
- the same GEMM reading its weight in place from pinned host memory (zero copy), at the same M.
And what a block costs beyond its GEMMs (norms, rotary, attention over the sequence, activations,
projections smaller than the probe's GEMM), per unit of activation width, from a Llama-style block
timed in a CUDA graph.
Cached per GPU model in $XDG_CACHE_HOME/weightstream (default ~/.cache/weightstream).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..devices import resolve_device
from ..wire.codec import DECODER_VERSION
from .timing import capture_graph, time_calls

TOKENS = (1, 16, 64, 256, 1024, 2048, 8192)


@dataclass(frozen=True)
class MachineProfile:
    """Measured rates of one GPU and its link. `resident` and `uva` map tokens per forward (M) to
    seconds per weight byte of a bf16 GEMM; `copy_s_per_byte` is the pinned host->GPU copy."""

    gpu: str
    copy_s_per_byte: float
    resident: dict[int, float]
    uva: dict[int, float]
    # tokens -> seconds per block per unit of activation width, beyond its GEMM time ({}: none known)
    block_extra: dict[int, float] = field(default_factory=dict)
    # tokens -> a dequantizing GEMM's time (fp8 weight with block scales, dequantized then multiplied)
    # over the bf16 GEMM of the same weights ({}: DEQUANT_DEFAULT)
    dequant: dict[int, float] = field(default_factory=dict)
    # GPU decode of compressed groups (wire/triton_decoder.py), seconds per decoded byte; the default
    # (300 GB/s) stands in where it was not measured
    decode_s_per_byte: float = 1 / 300e9
    # the decoder generation (codec.DECODER_VERSION) that decode rate was measured with; "": not measured
    decoder: str = ""
    # device seconds of one GPU expert cache layer's table update and gather per forward, besides the
    # bytes it moves (about 70 small kernels, whatever the tokens); not probed: measured from a CUDA graph
    # on an H100, qwen3-30b-a3b with 48 cached layers and every read a hit, 26.59 ms per token against
    # the resident 14.07 ms (benchmarks/results/2026-12-07_h100_qwen3-30b-a3b-skew-cache/README.md)
    expert_gather_seconds: float = 0.26e-3
    # seconds one layer of expert copies (engine/expert_cache.ExpertCopy) waits for the host to read its
    # routing and issue the copies (the GPU idle meanwhile); not probed, and not yet measured: a
    # stand-in of one small device-to-host copy, a stream synchronization and a copy launch
    expert_sync_seconds: float = 50e-6

    @property
    def h2d_GBps(self) -> float:
        return 1e-9 / self.copy_s_per_byte

    def copy_seconds(self, nbytes: int) -> float:
        """Seconds to copy nbytes host->GPU."""
        return nbytes * self.copy_s_per_byte

    def decode_seconds(self, nbytes: int) -> float:
        """Seconds to decode compressed groups into nbytes of slot on the GPU."""
        return nbytes * self.decode_s_per_byte

    def resident_seconds(self, nbytes: int, tokens: int) -> float:
        """Seconds for GEMMs over nbytes of resident weights at `tokens` tokens per forward."""
        return nbytes * _interpolate(self.resident, tokens)

    def uva_seconds(self, nbytes: int, tokens: int) -> float:
        """Seconds for the same GEMMs reading their weights in place over the link."""
        return nbytes * _interpolate(self.uva, tokens)

    def block_extra_seconds(self, width: int, tokens: int) -> float:
        """Seconds a block of activation width `width` (hidden size) spends outside its GEMMs."""
        return width * _interpolate(self.block_extra, tokens) if self.block_extra and width else 0.0

    def dequant_ratio(self, tokens: int) -> float:
        """A dequantizing GEMM's time over a bf16 GEMM's of the same weights at `tokens` tokens."""
        points = sorted((self.dequant or DEQUANT_DEFAULT).items())
        tokens = min(max(tokens, points[0][0]), points[-1][0])  # a ratio: held flat past the ends
        for (m0, v0), (m1, v1) in zip(points, points[1:], strict=False):
            if m0 <= tokens <= m1:
                return v0 + (math.log(tokens) - math.log(m0)) / (math.log(m1) - math.log(m0)) * (v1 - v0)
        return points[0][1]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> MachineProfile:
        data = json.loads(text)
        for key in ("resident", "uva", "block_extra", "dequant"):
            data[key] = {int(m): v for m, v in data.get(key, {}).items()}
        data.pop("block_overhead_s", None)  # an earlier format's field, always 0
        return cls(**data)


# Where no GPU measured it: an fp8 weight dequantized into bf16 then multiplied moves 1 + 2 + 2 bytes a
# weight where the bf16 GEMM reads 2 (x2.5, memory bound at few tokens); at 2048 tokens the GEMM is
# compute bound and the dequantize is one extra weight-sized elementwise pass (x1.13 on an H200's rates).
DEQUANT_DEFAULT = {1: 2.5, 64: 2.5, 2048: 1.13}


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
# benchmarks/results/2026-12-02_h200_llama-3-8b-planner-sweep/plan_llama-3-8b.json;
# used to plan where no GPU can be measured (the CPU backend,
# `weightstream plan` on a machine without CUDA).
H200 = MachineProfile(
    gpu="NVIDIA H200 (reference, measured 2026-12-02)",
    copy_s_per_byte=1.81323e-11,
    resident={1: 4.704e-13, 16: 4.437e-13, 64: 4.867e-13, 256: 5.71e-13,
        1024: 1.567e-12, 2048: 2.854e-12, 8192: 1.15e-11},
    uva={1: 2.06e-11, 16: 2.039e-11, 64: 2.118e-11, 256: 4.086e-11,
        1024: 8.01e-11, 2048: 1.585e-10, 8192: 7.534e-10},
    block_extra={1: 3.107e-09, 16: 1.26e-08, 64: 1.113e-08, 256: 2.094e-08,
        1024: 4.996e-08, 2048: 1.206e-07, 8192: 5.616e-07},
)


def _time_ms(fn, reps: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of `reps` calls of fn after `warmup` calls (CUDA events)."""
    for _ in range(warmup):
        fn()
    return statistics.median(time_calls(fn, reps, torch.device("cuda"), back_to_back=False)[0])


def measure(device: torch.device | str = "cuda", progress: bool = True) -> MachineProfile:
    """Measure this GPU: pinned copy bandwidth, bf16 GEMM time per weight byte (resident and zero
    copy) and a block's time outside its GEMMs, at each M in TOKENS. Takes about ten seconds."""
    from ..engine.uva import uva_view

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
    dequant = dequant_ratios(weight, resident, progress)
    profile = MachineProfile(torch.cuda.get_device_name(device), copy_s_per_byte, resident, uva)
    extra = block_extra(profile, device, progress)
    decode, decoder = decode_seconds_per_byte(device, progress)
    return MachineProfile(profile.gpu, copy_s_per_byte, resident, uva, extra, dequant, decode, decoder)


def dequant_ratios(weight: torch.Tensor, resident: dict[int, float],
                   progress: bool = False) -> dict[int, float]:
    """At each M in TOKENS: the time of `weight` (bf16, on the GPU) quantized to fp8 with 128x128 block
    scales, dequantized and multiplied (fp8.Fp8Linear's forward), over `resident`'s bf16 GEMM time."""
    from ..formats.fp8 import dequantize, quantize

    q, scale = quantize(weight, (128, 128))
    n, k = weight.shape
    ratios = {}
    for m in TOKENS:
        x = torch.randn(m, k, device=weight.device, dtype=torch.bfloat16)
        ms = _time_ms(lambda x=x: x @ dequantize(q, scale, (128, 128), torch.bfloat16).t())
        ratios[m] = ms / (resident[m] * n * k * 2 * 1e3)
        if progress:
            print(f"  M={m:5d}: fp8 dequantizing GEMM {ratios[m]:5.2f}x the bf16 GEMM", flush=True)
    return ratios


def decode_seconds_per_byte(device: torch.device, progress: bool = False) -> tuple[float, str]:
    """The codec's GPU decode time per output byte (Triton) and the decoder generation measured
    (`codec.DECODER_VERSION`); the default rate and "" where Triton is missing."""
    try:
        from ..wire.triton_decoder import decode_seconds_per_byte as measure_decode
    except ImportError:
        return MachineProfile.decode_s_per_byte, ""
    seconds = measure_decode(device)
    if progress:
        print(f"  codec decode: {1e-9 / seconds:8.1f} GB/s of decoded weights", flush=True)
    return seconds, DECODER_VERSION


# The reference block: Llama-3-8B's decoder layer (width 4096, 32 query and 8 key/value heads of 128,
# MLP 14336), written as transformers' eager Llama layer runs it: fp32 RMSNorm, rotate-half rotary,
# SDPA with grouped heads, SiLU-gated MLP.
REF_WIDTH, REF_MLP, REF_HEADS, REF_KV_HEADS, REF_HEAD_DIM = 4096, 14336, 32, 8, 128


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def reference_block(device: torch.device):
    """A Llama-3-8B-sized decoder layer with random bf16 weights: `(forward(x), weight_bytes)` where
    forward maps activations (1, tokens, REF_WIDTH) to the same shape."""
    def w(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16) * 0.02

    kv = REF_KV_HEADS * REF_HEAD_DIM
    wq, wk, wv, wo = w(REF_WIDTH, REF_WIDTH), w(kv, REF_WIDTH), w(kv, REF_WIDTH), w(REF_WIDTH, REF_WIDTH)
    gate, up, down = w(REF_MLP, REF_WIDTH), w(REF_MLP, REF_WIDTH), w(REF_WIDTH, REF_MLP)
    norm1, norm2 = torch.ones(REF_WIDTH, device=device, dtype=torch.bfloat16), torch.ones_like(wq[0])
    gemm_bytes = sum(t.numel() * t.element_size() for t in (wq, wk, wv, wo, gate, up, down))

    def forward(x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        angles = torch.arange(t, device=device, dtype=torch.float32)[:, None] * torch.linspace(
            0, 1, REF_HEAD_DIM, device=device)[None, :]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        h = _rms_norm(x, norm1)
        q = (h @ wq.t()).view(1, t, REF_HEADS, REF_HEAD_DIM).transpose(1, 2)
        k = (h @ wk.t()).view(1, t, REF_KV_HEADS, REF_HEAD_DIM).transpose(1, 2)
        v = (h @ wv.t()).view(1, t, REF_KV_HEADS, REF_HEAD_DIM).transpose(1, 2)
        a = torch.nn.functional.scaled_dot_product_attention(
            _rotate(q, cos, sin), _rotate(k, cos, sin), v, is_causal=t > 1, enable_gqa=True)
        x = x + a.transpose(1, 2).reshape(1, t, REF_WIDTH) @ wo.t()
        h = _rms_norm(x, norm2)
        return x + (torch.nn.functional.silu(h @ gate.t()) * (h @ up.t())) @ down.t()

    return forward, gemm_bytes


def block_extra(profile: MachineProfile, device: torch.device, progress: bool = False) -> dict[int, float]:
    """Seconds per block per unit of width beyond the GEMM time `profile` predicts, at each M in
    TOKENS: the reference block replayed from a CUDA graph (no launch gaps, as a captured or
    compute-bound forward runs), minus its GEMM bytes at `profile`'s resident rate; never below 0."""
    forward, gemm_bytes = reference_block(device)
    extra = {}
    for m in TOKENS:
        x = torch.randn(1, m, REF_WIDTH, device=device, dtype=torch.bfloat16)
        replay = capture_graph(forward, x)
        block_s = _time_ms(replay) / 1e3
        extra[m] = max(0.0, block_s - profile.resident_seconds(gemm_bytes, m)) / REF_WIDTH
        if progress:
            print(f"  M={m:5d}: reference block {block_s * 1e3:7.3f} ms, of which "
                  f"{extra[m] * REF_WIDTH * 1e3:6.3f} ms outside the GEMMs", flush=True)
        del replay
    return extra


def copy_seconds_per_byte(device: torch.device, nbytes: int = 2**30) -> float:
    """Pinned host->GPU copy time per byte (median of 10 copies of 1 GiB)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return _time_ms(lambda: dst.copy_(src, non_blocking=True)) / 1e3 / nbytes


def cache_path(gpu: str) -> Path:
    """Where the profile of GPU model `gpu` is cached."""
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "weightstream"
    return root / ("profile-" + "".join(c if c.isalnum() else "_" for c in gpu) + ".json")


def cached_profile(path: Path) -> MachineProfile | None:
    """The profile cached at `path`, or None when there is none, it predates block times, or its decode
    rate was measured with another decoder generation than this one while Triton could measure this
    one (`codec.DECODER_VERSION`): such a profile is measured again."""
    if not path.is_file():
        return None
    profile = MachineProfile.from_json(path.read_text())
    if not profile.block_extra:
        return None
    if profile.decoder != DECODER_VERSION and importlib.util.find_spec("triton") is not None:
        return None
    return profile


def load_profile(device: torch.device | str | None = None, refresh: bool = False) -> MachineProfile:
    """This GPU's profile from the cache, measured (and cached) when absent or when `refresh`. Without
    CUDA, the reference H200 profile."""
    device = resolve_device(device, index=False)
    if device.type != "cuda":
        return H200
    path = cache_path(torch.cuda.get_device_name(device))
    cached = None if refresh else cached_profile(path)
    if cached is not None:
        return cached
    print(f"weightstream: measuring this GPU for the planner (about ten seconds, once; cached in {path})",
          file=sys.stderr, flush=True)
    profile = measure_in_child(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.to_json())
    return profile


def measure_in_child(device: torch.device) -> MachineProfile:
    """`measure(device)` run in a child process: its GPU buffers, pinned buffers and CUDA graphs never
    enter this process's caching allocator or memory statistics (the caller may be mid-offload)."""
    package_root = str(Path(__file__).resolve().parents[2])  # the folder holding weightstream/
    path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    index = device.index if device.index is not None else torch.cuda.current_device()
    done = subprocess.run([sys.executable, "-m", "weightstream.placement.probe", str(index)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"measuring cuda:{index} for the planner failed in a child process "
                           f"({sys.executable} -m weightstream.placement.probe {index}):\n"
                           f"{done.stderr[-2000:]}")
    return MachineProfile.from_json(done.stdout)


if __name__ == "__main__":  # the child of `measure_in_child`: the profile of cuda:<index> as JSON
    print(measure(torch.device("cuda", int(sys.argv[1])), progress=False).to_json())
