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


def test_moe_shapes_record_what_differs_from_the_published_model():
    assert "bf16" in shapes.get_shape("gpt-oss-20b").record()["note"]
    assert "plan only" in shapes.get_shape("qwen3-235b-a22b").record()["note"]
    assert "note" not in shapes.get_shape("qwen3-30b-a3b").record()


def test_a_model_class_without_sdpa_is_built_with_eager_attention_and_the_record_says_so():
    """transformers has no SDPA path for GPT-OSS (its attention sinks): building it with SDPA fails, so
    the bench builds it, reference and offloaded alike, with eager attention and records that."""
    gpt_oss, qwen = shapes.get_shape("gpt-oss-20b"), shapes.get_shape("qwen3-30b-a3b")
    assert gpt_oss.model.config(gpt_oss.fields)._attn_implementation == "eager"
    assert "eager" in gpt_oss.record()["attention"]
    assert qwen.model.config(qwen.fields)._attn_implementation == "sdpa"
    assert "attention" not in qwen.record()
    model = gpt_oss.model.meta(gpt_oss.fields)
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("name, experts, top_k", [("qwen3-30b-a3b", 128, 8), ("gpt-oss-20b", 32, 4),
                                                  ("deepseek-v2-lite", 64, 6), ("qwen3-235b-a22b", 128, 8)])
def test_moe_shapes_plan_routed_reads_at_decode_and_copies_at_prefill(name, experts, top_k):
    """Fused 3-D experts are counted as routed: at one token a block reads top_k of its experts, so
    blocks off the GPU are read in place; at 2048 tokens every expert is reached and copies win."""
    import weightstream as ws
    from weightstream.placement.prepare import prepare
    from weightstream.placement.shapes import meta_model

    model = meta_model(name)
    decode = prepare(model, gpu_memory="8GiB", device="cpu", allow_meta=True, profile=ws.REFERENCE_PROFILE)
    cost = decode.cost
    assert (cost.experts, cost.top_k) == (experts, top_k)
    assert sum(cost.routed_bytes) > 0.9 * sum(cost.block_bytes)  # the experts are most of every block
    assert decode.placement.kind == "uva" and len(decode.placement.uva) > len(cost.block_bytes) // 2
    read = sum(sum(n for n, _ in cost.reads(b, 1)) for b in decode.placement.uva)
    uva_bytes = sum(cost.block_bytes[b] for b in decode.placement.uva)
    assert read < 0.25 * uva_bytes  # routed experts only (plus the dense part)
    prefill = prepare(model, gpu_memory="8GiB", device="cpu", allow_meta=True, tokens=2048,
                      profile=ws.REFERENCE_PROFILE)
    assert prefill.placement.kind == "stream" and not prefill.placement.uva


def test_a_shape_host_memory_cannot_hold_is_refused_with_plan_as_the_way_out(monkeypatch):
    from weightstream.engine import host

    monkeypatch.setattr(host, "available_host_bytes", lambda: 2**30)
    with pytest.raises(ValueError, match=r"qwen3-30b-a3b: its .* host memory, which has 1.00 GiB available: "
                                         r"plan it instead \(weightstream plan qwen3-30b-a3b"):
        shapes.check_shape(shapes.get_shape("qwen3-30b-a3b"), torch.device("cpu"))
    shapes.check_shape(shapes.get_shape("tiny-moe"), torch.device("cpu"))  # tiny shapes: never refused



@pytest.mark.parametrize("shape", [(1, 1), (2, 6), (1, 12)])  # 12 > the sliding window (4)
def test_an_eager_attention_model_gets_its_masks_built_once_and_gives_the_same_bits(shape, monkeypatch):
    """GPT-OSS (eager attention: sliding and full layers) builds its float masks at every forward (in
    transformers 5.17 with a host scalar copied to the device, which a CUDA graph capture refuses); the
    bench's forward builds them once per input shape and passes them, and the model builds none, with
    the logits of the model's own forward."""
    from model_zoo import gpt_oss
    from transformers.models.gpt_oss import modeling_gpt_oss

    from weightstream.bench.causal_lm import CAUSAL_LM

    built = []
    for name in ("create_causal_mask", "create_sliding_window_causal_mask"):
        own = getattr(modeling_gpt_oss, name)
        monkeypatch.setattr(modeling_gpt_oss, name,
                            lambda *a, _own=own, _name=name, **k: built.append(_name) or _own(*a, **k))
    model, _ = gpt_oss()
    model.eval()
    assert model.config._attn_implementation == "eager"
    ids = torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(sum(shape)))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        assert sorted(set(built)) == ["create_causal_mask", "create_sliding_window_causal_mask"]
        built.clear()
        first, again = (CAUSAL_LM.forward(model, ids) for _ in range(2))
    assert built == []
    assert torch.equal(first, expected) and torch.equal(again, expected)

def test_an_sdpa_model_is_run_as_it_is():
    from weightstream.bench.causal_lm import CAUSAL_LM

    model = shapes.build_model("tiny", torch.device("cpu"))
    assert model.config._attn_implementation == "sdpa"
    assert CAUSAL_LM.masks(model, torch.zeros(1, 4, dtype=torch.long)) is None


@pytest.mark.gpu
def test_an_eager_attention_model_is_captured_in_a_cuda_graph_by_the_bench_forward():
    """The bench's GPT-OSS forward is captured in a CUDA graph (transformers 5.17's own cannot be: its
    eager mask copies a host scalar) and its replay gives the eager forward's logits."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from model_zoo import gpt_oss

    from weightstream.bench.causal_lm import CAUSAL_LM
    from weightstream.placement.timing import capture_graph

    model, _ = gpt_oss()
    model = model.to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 128, (1, 1), device="cuda")
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        replay = capture_graph(lambda x: CAUSAL_LM.forward(model, x), ids)
        assert torch.equal(replay(), expected)
