"""`weightstream bench` on mixtures of experts: `--routing-skew S` (Zipf expert popularity, recorded as
synthetic in the shape record of every result document), its refusals, and that routing without it is
recorded as what the random weights give."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import wide_moe

from weightstream.bench import cli
from weightstream.bench.causal_lm import skew_routing
from weightstream.bench.shapes import SHAPES, build_model, routing_skew
from weightstream.placement.experts import routers

pytest.importorskip("transformers")


def popularity(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each router's share of the token-expert choices per expert, over one forward."""
    counts = []
    hooks = [r.register_forward_hook(lambda m, a, out: counts.append(
        torch.bincount(out[-1].flatten(), minlength=m.num_experts).double())) for _, r in routers(model)]
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in hooks:
        h.remove()
    return [c / c.sum() for c in counts]


def zipf_top_share(experts: int, top_k: int, s: float, most: int) -> float:
    """The share of token-expert choices the `most` most popular experts take when tokens draw `top_k`
    experts without replacement in proportion to rank^-s (Gumbel top-k)."""
    gen = torch.Generator().manual_seed(0)
    logits = -s * torch.log(torch.arange(1, experts + 1, dtype=torch.float64))
    gumbel = -torch.log(-torch.log(torch.rand(20000, experts, generator=gen, dtype=torch.float64)))
    chosen = torch.topk(logits + gumbel, top_k).indices
    return (chosen < most).double().mean().item()


def test_routing_skew_makes_expert_popularity_zipf_like_permuted_per_layer_and_seeded():
    ids = torch.randint(0, 512, (1, 96), generator=torch.Generator().manual_seed(0))
    model = wide_moe()
    again = copy.deepcopy(model)
    assert skew_routing(model, 1.2, seed=3) == 2
    skewed = popularity(model, ids)
    ideal = zipf_top_share(32, 4, 1.2, 4)  # about 0.5 (uniform: 0.125)
    for after in skewed:  # Gumbel top-k of the Zipf law, whatever the random weights' own routing was
        assert abs(after.sort(descending=True).values[:4].sum() - ideal) < 0.08
    assert not torch.equal(skewed[0].argsort(), skewed[1].argsort())  # a permutation of its own per layer
    skew_routing(again, 1.2, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(popularity(again, ids), skewed, strict=True))


def test_skew_zero_routes_a_prefill_to_every_expert_in_every_layer_and_decode_steps_apart():
    """Random weights alone concentrate routing in deeper layers; `--routing-skew 0` (Gumbel noise
    hashed from each token's hidden state) spreads it: no expert takes much more than its share, every
    expert is reached by a 96-token prefill in every layer, and single tokens route apart."""
    model = wide_moe(layers=4)
    ids = torch.randint(0, 512, (1, 96), generator=torch.Generator().manual_seed(5))
    skew_routing(model, 0.0, seed=1)
    for share in popularity(model, ids):
        assert (share > 0).all() and share.max() < 3 / 32
    chosen = []
    hooks = [r.register_forward_hook(lambda m, a, out: chosen.append(out[-1].flatten().tolist()))
             for _, r in routers(model)]
    with torch.no_grad():
        for token in range(8):
            model(torch.tensor([[token * 37]]), use_cache=False)
    for h in hooks:
        h.remove()
    last = [chosen[i] for i in range(3, len(chosen), 4)]  # the deepest layer's choice for each token
    assert len({tuple(sorted(c)) for c in last}) > 4


def test_a_skewed_model_offloads_exactly():
    import weightstream as ws

    ref = wide_moe()
    skew_routing(ref, 1.0, seed=0)
    model = copy.deepcopy(ref)
    ws.offload(model, gpu_memory=sum(p.nbytes for p in model.parameters()) // 3, device="cpu", strategy="uva")
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids, use_cache=False).logits, ref(ids, use_cache=False).logits)


def test_the_registry_is_restored_and_the_shape_record_says_synthetic():
    plain = SHAPES["tiny-moe"]
    assert "no synthetic routing skew" in plain.record()["routing"] and plain.record()["routing_skew"] is None
    assert "routing" not in SHAPES["tiny"].record()
    with routing_skew("tiny-moe", 1.5, seed=2):
        record = SHAPES["tiny-moe"].record()
        assert record["routing"].startswith("synthetic routing skew") and record["routing_skew"] == 1.5
        model = build_model("tiny-moe", torch.device("cpu"), seed=2)
        assert any(r._forward_pre_hooks for _, r in routers(model))  # Mixtral's router has no bias
    assert SHAPES["tiny-moe"] is plain


@pytest.mark.parametrize("skew", [None, 1.0])
def test_a_cpu_run_records_its_routing_in_the_document_and_the_printout(tmp_path, capsys, skew):
    out = tmp_path / "moe.json"
    argv = ["--device", "cpu", "--shape", "tiny-moe", "--budgets", "0.5", "--phases", "decode-b1",
            "--methods", "resident,ws-uva", "--modes", "eager", "--reps", "1", "--no-timeline",
            "--out", str(out)] + ([] if skew is None else ["--routing-skew", str(skew)])
    assert cli.main(argv) == 0
    doc = json.loads(out.read_text())
    assert all(r["exact"] in (None, True) for r in doc["results"])
    routing = doc["shape"]["routing"]
    assert routing.startswith("synthetic routing skew: ") == (skew is not None)
    assert doc["shape"]["routing_skew"] == skew
    assert routing in capsys.readouterr().out
    assert SHAPES["tiny-moe"].routing_skew is None


@pytest.mark.parametrize("argv, says", [
    (["--shape", "tiny", "--routing-skew", "1.0"], "applies to mixtures of experts"),
    (["--shape", "tiny-moe", "--routing-skew", "-1"], "Zipf exponent of 0 (uniform routing) or more"),
    (["--shape", "tiny-moe", "--routing-skew", "nan"], "Zipf exponent of 0 (uniform routing) or more"),
    (["--kind", "codec", "--routing-skew", "1.0"], "--routing-skew does not apply to --kind codec"),
    (["--shape", "tiny-moe", "--routing-skew", "inf"], "Zipf exponent of 0 (uniform routing) or more"),
])
def test_routing_skew_refusals_are_one_line_and_exit_2(capsys, argv, says):
    assert cli.main(["--device", "cpu", *argv, "--out", "/nonexistent/never.json"]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


def test_whole_block_zero_copy_against_experts_in_place_on_the_cpu(tmp_path):
    """`ws-uva-whole-blocks` reads zero-copy blocks whole, `ws-uva` may read only their routed experts:
    both exact, and the placements say which."""
    out = tmp_path / "uva.json"
    assert cli.main(["--device", "cpu", "--shape", "tiny-moe", "--budgets", "0.3", "--phases", "decode-b1",
                     "--methods", "resident,ws-uva,ws-uva-whole-blocks", "--modes", "eager", "--reps", "1",
                     "--no-timeline", "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["ws-uva"]["exact"] and rows["ws-uva-whole-blocks"]["exact"]
    assert "only their routed experts" in rows["ws-uva"]["setup"]["placement"]
    assert "routed experts" not in rows["ws-uva-whole-blocks"]["setup"]["placement"]
    predicted = {m: rows[m]["setup"]["prediction"]["warm_ms"] for m in ("ws-uva", "ws-uva-whole-blocks")}
    assert predicted["ws-uva"] < predicted["ws-uva-whole-blocks"]
    # the expert bytes read per token, counted after the timed calls: top_k experts of each zero-copy
    # block at one token, whole blocks or not (a GEMM in place reads only its routed experts' rows)
    fields = SHAPES["tiny-moe"].fields
    experts_in_place = rows["ws-uva"]["setup"]["stats"]["uva_bytes"]  # every block's routed experts
    want = experts_in_place * fields["num_experts_per_tok"] // fields["num_local_experts"]
    for m in ("ws-uva", "ws-uva-whole-blocks"):
        assert rows[m]["setup"]["expert_bytes_per_token"] == want > 0
    assert "expert_bytes_per_token" not in rows["resident"]["setup"]


def test_ws_auto_skew_tells_the_planner_the_synthetic_skew_and_stays_exact(tmp_path):
    """`ws-auto-skew` plans with the skew `--routing-skew` gave the model (recorded beside its placement):
    exact against the resident model, as ws-auto."""
    out = tmp_path / "skew.json"
    assert cli.main(["--device", "cpu", "--shape", "tiny-moe", "--budgets", "0.5", "--phases", "decode-b1",
                     "--methods", "resident,ws-auto,ws-auto-skew", "--modes", "eager", "--reps", "1",
                     "--no-timeline", "--routing-skew", "2.0", "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["ws-auto"]["exact"] and rows["ws-auto-skew"]["exact"]
    assert rows["ws-auto-skew"]["setup"]["routing_skew"] == 2.0
    # the routers' choices over the 64 decode tokens the timed calls cycled through fit a skew
    assert rows["ws-auto"]["setup"]["routing_skew_fit"] >= 0
    assert "routing_skew" not in rows["ws-auto"]["setup"]
    assert build_model("tiny-moe", torch.device("cpu")).__dict__.get("synthetic_routing_skew") is None
    with routing_skew("tiny-moe", 2.0, seed=0):
        assert build_model("tiny-moe", torch.device("cpu")).synthetic_routing_skew == 2.0


def test_timed_calls_of_a_mixture_of_experts_cycle_through_inputs_and_compare_the_phases_own(tmp_path):
    """A GPU expert cache timed on one token again and again serves every call from the cache: the
    timed calls of a mixture of experts cycle through ROTATING_TOKENS tokens of fixed inputs (each call
    copies the next into the one input buffer, as a graph's static input), and the output compared with
    the reference is the phase's own input's. A dense model's calls keep the phase's one input."""
    from weightstream.bench import runner
    from weightstream.bench.phases import parse_phase

    decode, prefill = parse_phase("decode-b1"), parse_phase("prefill-8")
    suite = runner._start("tiny-moe", [0.5], [decode, prefill], ["eager"], 1, torch.device("cpu"),
                          str(tmp_path / "x.json"), 0, False, "test")
    bank = runner.rotating_inputs(suite, decode)
    assert bank.shape == (runner.ROTATING_TOKENS, 1, 1) and torch.equal(bank[0], suite.inputs["decode-b1"])
    assert len({tuple(b.flatten().tolist()) for b in bank}) > runner.ROTATING_TOKENS // 2
    assert runner.rotating_inputs(suite, prefill).shape == (runner.ROTATING_TOKENS // 8, 1, 8)
    seen = []
    suite.model.register_forward_pre_hook(lambda m, args, kw: seen.append(args[0].clone()), with_kwargs=True)
    call = runner.make_call(suite, "eager", suite.inputs["decode-b1"], None, decode, bank)
    outs = [call() for _ in range(len(bank))]
    assert [s.tolist() for s in seen] == [b.tolist() for b in [*bank[1:], bank[0]]]
    assert torch.equal(call.first(), outs[-1]) and torch.equal(seen[-1], bank[0])
    assert torch.equal(outs[-1], suite.forward_fn()(suite.inputs["decode-b1"]))
    dense = runner._start("tiny", [0.5], [decode], ["eager"], 1, torch.device("cpu"),
                          str(tmp_path / "y.json"), 0, False, "test")
    assert runner.rotating_inputs(dense, decode) is None
