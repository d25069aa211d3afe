"""The diffusion model kind of the bench (`bench/diffusion.py`) on the CPU: tiny Flux, Wan and T5-encoder
shapes run one `denoise-b2` step through the harness, every weightstream method exact against the
resident model; the published shapes' sizes and tokens per step come from their configs (meta device)."""

from __future__ import annotations

import pytest

from weightstream.bench import run_suite, validate
from weightstream.bench.phases import parse_phase
from weightstream.bench.shapes import get_shape, resolve_phase, shape_weight_bytes

pytest.importorskip("diffusers")


STEPS = [("tiny-flux", 16 + 8, 0.5), ("tiny-wan", 2 * 4 * 4, 0.8), ("tiny-t5", 8, 0.5)]


@pytest.mark.slow
@pytest.mark.parametrize("shape, tokens, budget", STEPS)
def test_a_denoising_step_runs_through_the_harness_exactly(tmp_path, shape, tokens, budget):
    doc = run_suite(shape, [budget], ["denoise-b2"], ["resident", "ws-stream", "ws-auto"], ["eager"], 1,
                    "cpu", str(tmp_path / "d.json"), command="test")
    assert validate(doc) is doc and not doc.get("aborted")
    assert doc["shape"]["name"] == shape and doc["shape"]["dtype"] == "bfloat16"
    rows = {r["method"]: r for r in doc["results"]}
    assert rows["resident"]["reference"] == "self" and rows["resident"]["tokens"] == 2 * tokens
    for name in ("ws-stream", "ws-auto"):
        r = rows[name]
        assert r["error"] is None and r["exact"] is True and r["reference"] == "resident eager", r
        assert r["setup"]["link_bytes"] > 0 and r["setup"]["stats"]["misses_last_pass"] == 0, r


def test_published_shapes_have_their_sizes_and_step_tokens():
    gib = 2**30
    sizes = {name: shape_weight_bytes(name) / gib for name in ("flux-dev-transformer", "wan2.1-14b",
                                                                  "t5-xxl-encoder")}
    assert 22.0 < sizes["flux-dev-transformer"] < 22.4  # 11.9e9 parameters in bf16
    assert 26.5 < sizes["wan2.1-14b"] < 26.8  # 14.3e9, its norms and time embedder in fp32
    assert 8.8 < sizes["t5-xxl-encoder"] < 9.0  # 4.76e9
    step = parse_phase("denoise-b1")
    assert resolve_phase(get_shape("flux-dev-transformer"), step).tokens == 4096 + 512
    assert resolve_phase(get_shape("wan2.1-14b"), step).tokens == 21 * 30 * 52
    assert resolve_phase(get_shape("t5-xxl-encoder"), step).tokens == 512
    assert resolve_phase(get_shape("tiny"), parse_phase("decode-b4")).tokens == 4  # LMs: unchanged

