"""The method registry of `weightstream bench`: run order, and methods skipped for a missing import."""

from __future__ import annotations

import importlib.util

from conftest import BENCH_WS as WS

from weightstream.bench import methods
from weightstream.bench.schema import MODES


def test_registry_lists_the_methods_and_skips_missing_imports_with_a_reason():
    names = [m.name for m in methods.METHODS]
    assert names == ["resident", *WS, "ws-auto-raw", "ws-auto-compress", "ws-auto-skew",
                     "ws-auto-copies", "ws-auto-copies-coded", "ws-uva-whole-blocks", "ws-stream-raw",
                     "ws-stream-compress",
                     "accelerate-cpu_offload", "accelerate-device_map", "diffusers-group", "diffusers-leaf",
                     "diffusers-model_cpu_offload",
                     "diffusers-sequential_cpu_offload"]
    registered, missing = methods.registry(), methods.unavailable()
    assert {"resident", *WS} <= set(registered)
    assert set(registered) | set(missing) == set(names) and not set(registered) & set(missing)
    for name, module in [("accelerate-cpu_offload", "accelerate"), ("accelerate-device_map", "accelerate"),
                         ("diffusers-group", "diffusers"), ("diffusers-leaf", "diffusers"),
                         ("diffusers-model_cpu_offload", "accelerate"),
                         ("diffusers-sequential_cpu_offload", "accelerate")]:
        if importlib.util.find_spec(module) is None:
            assert f"pip install {module}" in missing[name]
        else:
            assert registered[name].modes == ("eager",)
    assert all(methods.registry()[n].modes == MODES for n in ["resident", *WS])


def test_every_family_file_contributes_its_methods_in_order():
    """The registry is the families' METHODS tuples, concatenated in FAMILIES order: a peer is a file."""
    assert [m for f in methods.FAMILIES for m in f.METHODS] == list(methods.METHODS)
    assert len({m.name for m in methods.METHODS}) == len(methods.METHODS)


def test_a_weightstream_variant_passes_its_options_to_offload(monkeypatch):
    """A variant line (`ws_prepare(strategy, **options)`) reaches `offload` with its options, records its
    placement and prediction, and undoes to a model equal to the one before."""
    import torch

    from weightstream.bench.methods import weightstream as ws_methods
    from weightstream.bench.shapes import build_model

    seen = []

    def recording_offload(model, **kwargs):
        seen.append(kwargs)
        return real(model, **kwargs)

    real = ws_methods.offload
    monkeypatch.setattr(ws_methods, "offload", recording_offload)
    model = build_model("tiny", torch.device("cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(256, (1, 3))
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
    prepare = ws_methods.ws_prepare("stream", pin_memory=False)
    assert "strategy='stream', pin_memory=False" in prepare.__doc__
    total = sum(t.numel() * t.element_size() for t in before.values())
    info, undo = prepare(model, total // 2, 1, torch.device("cpu"))
    assert seen == [dict(gpu_memory=total // 2, device=torch.device("cpu"), strategy="stream", tokens=1,
                         pin_memory=False)]
    assert info["link_bytes"] > 0 and info["placement"].startswith("stream: ")
    assert info["prediction"] is None or info["prediction"]["ms"] > 0
    with torch.no_grad():
        assert torch.equal(model(ids, use_cache=False).logits, ref)
    undo()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
