"""The bench's model shapes: the planning shapes plus tiny ones, built with random weights."""

import pytest
import torch

from weightstream.bench import shapes
from weightstream.bench.memory import module_bytes
from weightstream.placement.shapes import SHAPES as PLANNING_SHAPES


def test_every_planning_shape_is_a_bench_shape_with_its_fields():
    for name, fields in PLANNING_SHAPES.items():
        assert shapes.SHAPES[name].fields == fields
    assert shapes.get_shape("tiny").record() == {"name": "tiny", **shapes.TINY, "dtype": "bfloat16"}
    with pytest.raises(ValueError, match="choose one of"):
        shapes.get_shape("no-such-shape")


def test_a_built_model_has_the_meta_builds_bytes_and_is_seeded():
    a, b = (shapes.build_model("tiny", torch.device("cpu"), seed=3) for _ in range(2))
    assert module_bytes(a) == shapes.shape_weight_bytes("tiny")
    assert next(a.parameters()).dtype == torch.bfloat16 and not a.training
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    assert all(torch.equal(x, y) for x, y in pairs)


def test_inputs_are_fixed_per_seed_and_shaped_by_the_phase():
    from weightstream.bench.phases import parse_phase

    shape = shapes.get_shape("tiny")
    model = shapes.build_model("tiny", torch.device("cpu"))
    phases = [parse_phase("decode-b4"), parse_phase("prefill-8")]
    x = shape.model.inputs(model, phases, torch.device("cpu"), seed=0)
    y = shape.model.inputs(model, phases, torch.device("cpu"), seed=0)
    assert x["decode-b4"].shape == (4, 1) and x["prefill-8"].shape == (1, 8)
    assert all(torch.equal(x[k], y[k]) for k in x)
    assert shape.model.forward(model, x["prefill-8"]).shape == (1, 8, shapes.TINY["vocab_size"])


def test_a_shape_too_big_for_the_gpu_is_built_on_the_cpu():
    assert shapes.build_device(10, torch.device("cpu")) == (torch.device("cpu"), "built on the CPU device")
