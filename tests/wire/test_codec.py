"""The wire codec: bit-exact round trips of every dtype, shape and special value; ratios on Hugging
Face-initialized weights; the GPU kernel against the reference decoder (run by Triton's interpreter on
the CPU, and compiled on a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightstream.placement.layout import pack
from weightstream.wire import codec

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.int64, torch.uint8,
          torch.float8_e4m3fn]


def hf_init(n: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Weights as Hugging Face initializes Linear layers: normal, std 0.02."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * 0.02).to(dtype)


def random_bits(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=gen).view(dtype)


def round_trip(tensors: list[torch.Tensor]):
    """Lay `tensors` out as a group, encode it, decode it; return (decoded group bytes, encoding,
    original group bytes); the decoded bytes are the original ones when the group is sent raw."""
    slices, size = pack([t.numel() * t.element_size() for t in tensors])
    raw = torch.zeros(size, dtype=torch.uint8)
    for t, sl in zip(tensors, slices, strict=True):
        raw[sl.offset : sl.offset + sl.nbytes] = t.reshape(-1).view(torch.uint8)
    enc = codec.encode_group([(t, sl.offset) for t, sl in zip(tensors, slices, strict=True)], size)
    if enc is None:
        return raw, None, raw
    out = torch.zeros(size, dtype=torch.uint8)
    codec.decode_group(enc.blob, out)
    assert enc.raw_bytes == size
    return out, enc, raw


def assert_exact(tensors: list[torch.Tensor]) -> codec.EncodedGroup | None:
    slices, size = pack([t.numel() * t.element_size() for t in tensors])
    out, enc, _ = round_trip(tensors)
    for t, sl in zip(tensors, slices, strict=True):
        assert torch.equal(out[sl.offset : sl.offset + sl.nbytes], t.reshape(-1).view(torch.uint8))
    if enc is not None:
        assert enc.wire_bytes <= codec.MAX_RATIO * enc.raw_bytes
    return enc


SPECIALS = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40, -1e-40, 6e-8, -6e-8, 1e30, 65504.0]


@st.composite
def tensors(draw, max_n: int | None = None):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))
    n = 1
    for s in shape:
        n *= s
    n *= draw(st.sampled_from([1, 1, 100, codec.CHUNK // 7]))  # up to several chunks
    n = min(n, max_n or n)
    mode = draw(st.sampled_from(["hf", "bits", "equal", "specials", "spread"]))
    seed = draw(st.integers(0, 2**16))
    if mode == "bits" or not dtype.is_floating_point or dtype == torch.float8_e4m3fn:
        t = random_bits(n, dtype, seed)
    elif mode == "equal":
        # filled in fp32 and cast: torch.full refuses a value out of fp16's range (1e30 becomes inf)
        t = torch.full((n,), draw(st.sampled_from(SPECIALS + [1.0, 0.02]))).to(dtype)
    elif mode == "spread":  # exponents over `width` values, a share `far` off them: every code width
        width, far = draw(st.integers(1, 20)), draw(st.sampled_from([0.0, 0.01, 0.2]))
        gen = torch.Generator().manual_seed(seed)
        e = torch.randint(-8, -8 + width, (n,), generator=gen).float()
        e[torch.rand(n, generator=gen) < far] -= 12
        sign = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
        t = (torch.exp2(e) * (1 + torch.rand(n, generator=gen)) * sign).to(dtype)
    else:
        t = hf_init(n, dtype, seed)
        if mode == "specials":
            gen = torch.Generator().manual_seed(seed)
            where = torch.randint(0, n, (max(1, n // 50),), generator=gen)
            t[where] = torch.tensor(SPECIALS, dtype=torch.float32)[where % len(SPECIALS)].to(dtype)
    return t.reshape(-1)[:n].reshape(n)


@settings(max_examples=60, deadline=None)
@given(st.lists(tensors(), min_size=1, max_size=4))
def test_round_trip_is_bit_exact(group):
    assert_exact(group)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 7, 64, codec.CHUNK - 1, codec.CHUNK, codec.CHUNK + 1, 5 * codec.CHUNK + 3])
def test_every_special_value_and_every_bit_pattern_survive(dtype, n):
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)  # all 65536
    t = torch.cat([hf_init(n, dtype), every[torch.randperm(every.numel())[: max(1, n // 10)]]])
    t[: min(n, len(SPECIALS))] = torch.tensor(SPECIALS[: min(n, len(SPECIALS))]).to(dtype)
    assert_exact([t])
    assert_exact([every])  # all 65536 patterns in one tensor (mostly escapes, or passed raw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_worst_cases_pass_raw_and_stay_exact(dtype):
    noise = random_bits(50_000, dtype, 1)
    assert codec.choose(noise).kind == codec.RAW
    assert assert_exact([noise]) is None  # the whole group is sent raw
    zeros = torch.zeros(50_000, dtype=dtype)
    enc = assert_exact([zeros])
    bound = 0.62 if dtype == torch.bfloat16 else 0.85  # k=1, no escapes (+ fp16 extra bits, chunk padding)
    assert enc.wire_bytes <= bound * zeros.numel() * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.int32, torch.float8_e4m3fn])
def test_other_dtypes_pass_raw(dtype):
    t = random_bits(10_000, dtype, 2)
    assert codec.choose(t).kind == codec.RAW
    assert codec.encode_group([(t, 0)], t.numel() * t.element_size()) is None


def test_hf_initialized_bf16_group_ratio_is_at_most_075():
    # a Llama-like block in miniature: big projections, a norm weight of ones, an fp32 buffer
    parts = [hf_init(512 * 1024, seed=1), hf_init(128 * 1024, seed=2), hf_init(1024 * 1792, seed=3),
             torch.ones(1024, dtype=torch.bfloat16), torch.arange(64, dtype=torch.float32)]
    enc = assert_exact(parts)
    assert enc.wire_bytes / enc.raw_bytes <= 0.75
    assert enc.wire_bytes / enc.raw_bytes >= 0.66  # the sign+mantissa byte is incompressible


def test_hf_initialized_fp16_compresses_and_prediction_matches():
    t = hf_init(300_000, torch.float16, 4)
    enc = assert_exact([t])
    assert enc.wire_bytes / enc.raw_bytes <= 0.94
    predicted = codec.choose(t).nbytes
    assert abs(predicted - enc.wire_bytes) <= 0.01 * enc.raw_bytes


def test_mixed_magnitudes_pick_a_wider_code():
    # exponents spread over many binades: k=4 covers more than k=3
    gen = torch.Generator().manual_seed(5)
    scale = torch.exp2(torch.randint(-6, 6, (100_000,), generator=gen).float())
    t = (torch.randn(100_000, generator=gen) * scale).bfloat16()
    assert codec.choose(t).k == 4
    assert_exact([t])


def test_bad_blob_is_refused():
    with pytest.raises(ValueError, match="magic"):
        codec.decode_group(torch.zeros(256, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8))


def test_a_tensor_at_an_unaligned_offset_is_refused():
    with pytest.raises(ValueError, match="multiples of 16"):
        codec.encode_group([(hf_init(4000), 8)], 8008)


def _interpreted(check: str) -> None:
    """Run `check` of tests/wire/interpreted_codec.py in a fresh Python with TRITON_INTERPRET=1: Triton's
    interpreter runs the GPU decoder's own code on the CPU (Triton reads the variable when it is first
    imported, and this process imported it already for torch.compile)."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (here, os.path.dirname(here), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    run = subprocess.run([sys.executable, "-c", f"import interpreted_codec; interpreted_codec.{check}()"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_gpu_kernel_run_by_tritons_interpreter_matches_the_reference():
    _interpreted("check_random_groups")


def test_the_interpreted_kernel_covers_every_kind_and_code_width():
    _interpreted("check_every_width")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_encoder_and_triton_decoder_match_the_reference(dtype):
    from weightstream.wire import triton_decoder as codec_triton

    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    parts = [hf_init(600_017, dtype, 1), every, hf_init(1000, dtype, 2),
             torch.arange(77, dtype=torch.float32), hf_init(2 * codec.CHUNK, dtype, 3),
             torch.zeros(5000, dtype=dtype), random_bits(20_000, dtype, 4)]
    parts[0][:len(SPECIALS)] = torch.tensor(SPECIALS).to(dtype)
    slices, size = pack([t.numel() * t.element_size() for t in parts])
    group = [(t, sl.offset) for t, sl in zip(parts, slices, strict=True)]
    cpu = codec.encode_group(group, size)
    gpu = codec.encode_group(group, size, device=torch.device("cuda"))
    assert gpu.blob.is_cuda and torch.equal(cpu.blob, gpu.blob.cpu())  # the same on either device
    expected = torch.zeros(size, dtype=torch.uint8)
    codec.decode_group(cpu.blob, expected)
    out = torch.zeros(size, dtype=torch.uint8, device="cuda")
    codec_triton.decode(cpu.blob.cuda(), out, cpu.chunks)
    assert torch.equal(out.cpu(), expected)
    for t, sl in zip(parts, slices, strict=True):
        assert torch.equal(out[sl.offset : sl.offset + sl.nbytes].cpu(), t.view(torch.uint8))
