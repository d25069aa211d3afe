"""`OffloadConfig`: every offload argument validated in one place, and taken alike by `offload`,
`from_pretrained`, the pipeline path and the command line."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import weightstream as ws
from weightstream.config import OffloadConfig
from weightstream.errors import ArgumentError

# each argument's values: (value, valid on the CPU backend)
CHOICES = {
    "gpu_memory": [(10**6, True), ("1MiB", True), ("lots", False), (-5, False), ("auto", False)],  # no GPU
    "device": [(None, True), ("cpu", True), ("tpu", False), (3.5, False)],
    "pin_memory": [(True, True), (False, True), ("no", False)],
    "strategy": [("auto", True), ("stream", True), ("uva", True), ("fast", False)],
    "compress": [("auto", True), (True, True), (False, True), ("yes", False), (1, False)],
    "tokens": [(1, True), (2048, True), (0, False), (True, False), (1.5, False)],
    "profile": [(None, True), (ws.REFERENCE_PROFILE, True), ("h200", False)],
    "check": [(None, True), (True, True), (False, True), ("yes", False)],
    "blocks": [(None, True), (["layers"], True), ("layers", False)],
    "keep_resident": [((), True), (["layers.0.k"], True), ("layers.0.k", False)],
}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({name: st.sampled_from(values) for name, values in CHOICES.items()}))
def test_a_config_is_built_exactly_when_every_argument_is_valid_and_a_mistake_names_its_argument(drawn):
    """Drawn mixes of valid and invalid arguments (on this CPU-only machine, so device=None is the
    CPU): the config is built, with resolved values, or raises ArgumentError naming a bad argument."""
    kwargs = {name: value for name, (value, _) in drawn.items()}
    bad = [name for name, (_, ok) in drawn.items() if not ok]
    if torch.cuda.is_available():
        pytest.skip("drawn for the CPU backend")
    if not bad:
        config = OffloadConfig(**kwargs)
        assert isinstance(config.gpu_memory, int) and config.device == torch.device("cpu")
        assert config.compress in (True, False)  # "auto" is raw on the CPU backend
        assert isinstance(config.check, bool) and isinstance(config.keep_resident, tuple)
        assert config.blocks is None or isinstance(config.blocks, tuple)
        assert config.replace() == config  # validated again, unchanged
        return
    with pytest.raises(ArgumentError) as info:
        OffloadConfig(**kwargs)
    message = str(info.value)
    assert any(name in message or (name == "gpu_memory" and "size" in message) for name in bad), message


def test_a_config_offloads_exactly_as_the_same_arguments_do():
    ref = make_model("llama", 0)
    a, b = make_model("llama", 0), make_model("llama", 0)
    weights = sum(t.numel() * t.element_size() for t in ref.state_dict().values())
    config = ws.OffloadConfig(weights * 3 // 5, device="cpu", strategy="stream", tokens=4)
    ha = ws.offload(a, config)
    hb = ws.offload(b, gpu_memory=weights * 3 // 5, device="cpu", strategy="stream", tokens=4)
    assert ha.config == config and hb.config == config
    assert ha.placement == hb.placement and ha.placement.streamed
    ids = torch.randint(0, ref.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(ids).logits
        assert torch.equal(a(ids).logits, expected) and torch.equal(b(ids).logits, expected)
    with ha.edit():  # edit() offloads again with the handle's config
        pass
    assert ha.config == config and ha.placement == hb.placement
    ha.restore()
    hb.restore()


def test_arguments_beside_a_config_are_refused_saying_where_they_go():
    model = make_model("llama", 0)
    config = ws.OffloadConfig("1GiB", device="cpu")
    with pytest.raises(ArgumentError, match=r"strategy given beside an OffloadConfig.*replace\(strategy"):
        ws.offload(model, config, strategy="stream")
    with pytest.raises(ArgumentError, match="tokens given beside an OffloadConfig"):
        ws.from_pretrained("/nonexistent", config, tokens=8)
    # a field set to its default value is not "given"
    handle = ws.offload(model, config, strategy="auto")
    assert handle.config == config
    handle.restore()


def test_from_pretrained_and_the_pipeline_path_take_a_config(tmp_path):
    ref = make_model("llama", 0)
    ref.save_pretrained(tmp_path)
    weights = sum(t.numel() * t.element_size() for t in ref.state_dict().values())
    config = ws.OffloadConfig(weights * 3 // 5, device="cpu", strategy="stream")
    model = ws.from_pretrained(tmp_path, config, progress=False)
    plain = ws.from_pretrained(tmp_path, weights * 3 // 5, device="cpu", strategy="stream", progress=False)
    assert ws.handle_of(model).placement == ws.handle_of(plain).placement
    ids = torch.randint(0, ref.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    ws.handle_of(model).restore()
    ws.handle_of(plain).restore()
    with pytest.raises(ArgumentError, match="tokens"):  # a pipeline plans each component's tokens
        ws.offload(_FakePipeline(), ws.OffloadConfig("1GiB", device="cpu", tokens=8))


class _FakePipeline:
    """Enough of a diffusers pipeline for `is_pipeline` (a `components` dict)."""

    components = {}


def test_the_command_line_reports_a_bad_offload_argument_in_one_line(capsys):
    from weightstream.cli import main

    assert main(["plan", "llama-3-8b", "--gpu-memory", "lots"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lots" in err[0] and "size" in err[0]


def test_every_field_of_the_config_is_an_argument_of_offload():
    import inspect

    names = {f.name for f in dataclasses.fields(OffloadConfig)}
    assert names <= set(inspect.signature(ws.offload).parameters)


def test_gpu_memory_auto_is_the_free_gpu_memory_minus_the_stated_headroom(monkeypatch):
    """As on a GPU machine (CUDA's queries answered here): free memory minus max(2 GiB, 10%); the
    default of offload, from_pretrained and the pipeline path; refused on the CPU backend."""
    import inspect

    from weightstream import config
    from weightstream.formats.hf import from_pretrained
    from weightstream.pipeline import offload_pipeline

    for function in (ws.offload, from_pretrained, offload_pipeline):
        assert inspect.signature(function).parameters["gpu_memory"].default == "auto"
    with pytest.raises(ArgumentError, match="gpu_memory='auto'.*give a size"):
        OffloadConfig(device="cpu")
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    asked = []
    for free, total, expected in [(70 * gib, 80 * gib, 62 * gib),  # 10% of 80 GiB is more than 2 GiB
                                  (10 * gib, 12 * gib, 8 * gib),  # 2 GiB is more than 10% of 12 GiB
                                  (1 * gib, 80 * gib, 0)]:  # nothing left
        def mem_get_info(device, f=free, t=total):
            asked.append(device)
            return f, t

        monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
        assert OffloadConfig().gpu_memory == expected
        assert OffloadConfig("AUTO", device="cuda").gpu_memory == expected
    assert asked[0] == torch.device("cuda", 0)
    assert config.auto_gpu_memory(torch.device("cuda", 0)) == 0


SLOW_LINK = dataclasses.replace(ws.REFERENCE_PROFILE, gpu="reference with a link 20x slower",
                                copy_s_per_byte=ws.REFERENCE_PROFILE.copy_s_per_byte * 20)
# every field the planner reads, with values that change some placement of a tiny mixture of experts
PLANNED = {
    "strategy": ["auto", "stream", "uva"],
    "tokens": [1, 16, 256],
    "profile": [None, ws.REFERENCE_PROFILE, SLOW_LINK],
    "expert_cache": [True, False],
    "routing_skew": [None, 0.0, 1.5],
    "expert_copies": [False, True],
}


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from model_zoo import mixtral

    model, _ = mixtral(0)
    model = model.eval().requires_grad_(False)
    folder = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(folder)
    return model, folder


def _placement_or_error(call):
    """What `call()` gives, or the type of the WeightstreamError it raises; warnings (what the planner
    could not take) are another test's."""
    import warnings

    from weightstream.errors import WeightstreamError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return call()
        except WeightstreamError as err:
            return type(err)


def _offloaded(model, *args, **kwargs):
    handle = ws.offload(model, *args, **kwargs)
    placement = handle.placement
    handle.restore()
    return placement


def _loaded(folder, *args, **kwargs):
    handle = ws.handle_of(ws.from_pretrained(folder, *args, progress=False, **kwargs))
    placement = handle.placement
    handle.restore()
    return placement


def _blocks(p) -> dict:
    """What the plan command reports of a placement."""
    return {"streamed": list(p.streamed), "zero_copy": list(p.uva), "experts_only": list(p.uva_experts),
            "copies": list(p.expert_copies), "cache_slots": p.expert_slots, "slots": p.n_slots}


def _reported(r: dict) -> dict:
    return {"streamed": r["streamed"]["blocks"], "zero_copy": r["zero_copy"]["blocks"],
            "experts_only": r["zero_copy"]["experts_only_blocks"], "copies": r["expert_copies"]["blocks"],
            "cache_slots": r["expert_cache"]["slots"], "slots": r["streamed"]["slots"]}


def _plan_command(folder, budget: int, fields: dict) -> dict:
    import contextlib
    import io
    import json

    from weightstream.cli import main

    argv = ["plan", str(folder), "--gpu-memory", str(budget), "--json", "--strategy", fields["strategy"],
            "--tokens", str(fields["tokens"])]
    if fields["routing_skew"] is not None:
        argv += ["--routing-skew", str(fields["routing_skew"])]
    if fields["expert_copies"]:
        argv.append("--expert-copies")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    assert status == 0, err.getvalue()
    return json.loads(out.getvalue())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fraction=st.sampled_from([0.2, 0.35, 0.5, 0.8]),
       fields=st.fixed_dictionaries({name: st.sampled_from(values) for name, values in PLANNED.items()}))
def test_every_planned_field_reaches_the_placement_through_every_entry_point(moe_checkpoint, fraction,
                                                                            fields):
    """A drawn config of a tiny mixture of experts on the CPU backend: `offload` and `from_pretrained`
    (given the config, or its fields as keywords) place it as the planner does with those fields, and
    `plan_report` and `weightstream plan` (where it has the options) report that placement for the
    tokens asked for."""
    from weightstream.placement.plan import Placement, plan
    from weightstream.placement.prepare import prepare
    from weightstream.planview import plan_report

    model, folder = moe_checkpoint
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    budget = int(weights * fraction)
    config = OffloadConfig(budget, device="cpu", **fields)
    cost = prepare(model, config.replace(placement=Placement((), 0, 0, 0, 0)), predict_wire=False).cost
    expected = _placement_or_error(lambda: plan(
        cost, budget, config.tokens, config.profile or ws.REFERENCE_PROFILE, config.strategy,
        compress=config.compress, expert_cache=config.expert_cache, expert_copies=config.expert_copies))
    assert _placement_or_error(lambda: _offloaded(model, config)) == expected
    assert _placement_or_error(lambda: _offloaded(model, budget, device="cpu", **fields)) == expected
    assert _placement_or_error(lambda: _loaded(folder, config)) == expected
    assert _placement_or_error(lambda: _loaded(folder, budget, device="cpu", **fields)) == expected
    report = _placement_or_error(lambda: plan_report(str(folder), config))
    if not isinstance(expected, Placement):
        assert report == expected
        return
    assert report["optimized_for_tokens"] == config.tokens and _reported(report) == _blocks(expected)
    if fields["profile"] is None and fields["expert_cache"]:  # what the command line can ask for
        shown = _plan_command(folder, budget, fields)
        assert shown["optimized_for_tokens"] == config.tokens and _reported(shown) == _blocks(expected)
