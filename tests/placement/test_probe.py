"""The machine profile: its JSON round trip, the block-time term, and the reference block (on CPU)."""

import json

import pytest
import torch

from weightstream.placement.probe import H200, REF_WIDTH, MachineProfile, cached_profile, reference_block


def test_profile_round_trips_through_json():
    assert MachineProfile.from_json(H200.to_json()) == H200


def test_a_profile_cached_before_block_times_loads_without_them():
    old = json.loads(H200.to_json())
    del old["block_extra"]
    old["block_overhead_s"] = 0.0  # the earlier format's field
    profile = MachineProfile.from_json(json.dumps(old))
    assert profile.block_extra == {} and profile.block_extra_seconds(4096, 1) == 0.0


def test_block_extra_scales_with_width_and_interpolates_in_tokens():
    profile = MachineProfile("t", 1.0, {1: 1.0}, {1: 1.0}, block_extra={1: 1e-6, 100: 3e-6})
    assert profile.block_extra_seconds(1000, 1) == pytest.approx(1e-3)
    assert profile.block_extra_seconds(2000, 10) == pytest.approx(2000 * 2e-6)  # halfway in log(tokens)
    assert profile.block_extra_seconds(0, 10) == 0.0  # unknown width: GEMM time only


def test_reference_profile_has_block_times_for_every_token_count():
    assert set(H200.block_extra) == set(H200.resident)
    assert all(v >= 0 for v in H200.block_extra.values())


def test_reference_block_keeps_the_activation_shape():
    forward, gemm_bytes = reference_block(torch.device("cpu"))
    # q, o: 4096^2; k, v: 1024 x 4096; gate, up, down: 14336 x 4096; bf16
    assert gemm_bytes == 2 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096)
    x = torch.randn(1, 3, REF_WIDTH, dtype=torch.bfloat16)
    y = forward(x)
    assert y.shape == x.shape and y.dtype == x.dtype and torch.isfinite(y).all()


def test_a_cached_profile_counts_only_with_block_times_and_this_decoder(tmp_path, monkeypatch):
    import dataclasses
    import importlib.util

    from weightstream.wire.codec import DECODER_VERSION

    path = tmp_path / "profile.json"
    assert cached_profile(path) is None  # nothing cached
    current = dataclasses.replace(H200, decode_s_per_byte=1e-12, decoder=DECODER_VERSION)
    path.write_text(current.to_json())
    assert cached_profile(path) == current
    old = json.loads(current.to_json())
    del old["block_extra"]
    path.write_text(json.dumps(old))
    assert cached_profile(path) is None  # cached before block times: measured again
    for stale in ("1", ""):  # an older decoder's rate, or a cache from before the field: measured again
        path.write_text(dataclasses.replace(current, decoder=stale).to_json())
        assert cached_profile(path) is None
    older = json.loads(current.to_json())
    del older["decoder"]
    path.write_text(json.dumps(older))
    assert cached_profile(path) is None
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real_find_spec(name, *a))
    assert cached_profile(path) == dataclasses.replace(current, decoder="")  # no Triton: nothing to measure


def test_dequant_ratio_defaults_interpolates_and_holds_past_the_ends():
    from weightstream.placement.probe import DEQUANT_DEFAULT, H200, MachineProfile

    assert H200.dequant_ratio(1) == DEQUANT_DEFAULT[1] and H200.dequant_ratio(10**6) == DEQUANT_DEFAULT[2048]
    p = MachineProfile("t", 1.0, {1: 1.0}, {1: 1.0}, dequant={1: 3.0, 100: 1.0})
    assert p.dequant_ratio(10) == pytest.approx(2.0) and p.dequant_ratio(10**5) == 1.0
    assert MachineProfile.from_json(p.to_json()) == p
