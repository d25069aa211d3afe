"""`weightstream bench --lora RANK` (`bench/lora.py`) on the CPU: an unfused LoRA adapter on a tiny
Flux denoiser and a tiny Llama, carried by the resident reference and every offloaded method, which
stay exact; the adapter changes the output (both matrices are drawn); bad ranks are one line, exit 2."""

from __future__ import annotations

import pytest
import torch

from weightstream.bench import run_suite, validate
from weightstream.bench.cli import main
from weightstream.bench.lora import add_lora
from weightstream.bench.shapes import build_model
from weightstream.errors import ArgumentError

pytest.importorskip("peft")


@pytest.mark.slow
@pytest.mark.parametrize("shape, phase, budget", [("tiny-flux", "denoise-b1", 0.95),
                                                  ("tiny", "decode-b1", 0.4)])
def test_an_unfused_lora_runs_exactly_through_every_method(tmp_path, shape, phase, budget):
    doc = run_suite(shape, [budget], [phase], ["resident", "ws-stream", "ws-auto"], ["eager"], 1, "cpu",
                    str(tmp_path / "l.json"), command="test", lora=4)
    assert validate(doc) is doc and not doc.get("aborted")
    assert doc["lora"]["rank"] == 4 and doc["lora"]["adapter_bytes"] > 0 and doc["lora"]["targets"]
    rows = {r["method"]: r for r in doc["results"]}
    for name in ("ws-stream", "ws-auto"):
        assert rows[name]["error"] is None and rows[name]["exact"] is True, rows[name]
    assert rows["ws-stream"]["setup"]["link_bytes"] > 0


def test_the_adapter_is_in_the_models_dtype_and_changes_its_output():
    model = build_model("tiny", "cpu", 0)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        record = add_lora(model, 8)
        after = model(ids).logits
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert lora and {p.dtype for p in lora} == {torch.bfloat16}
    assert record["adapter_bytes"] == sum(p.numel() * p.element_size() for p in lora)
    assert set(record["targets"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert not torch.equal(before, after)


def test_a_bad_rank_or_a_model_without_projections_is_refused(capsys):
    assert main(["--shape", "tiny", "--device", "cpu", "--lora", "0"]) == 2
    assert "--lora 0: give the adapter's rank" in capsys.readouterr().err
    assert main(["--kind", "codec", "--lora", "4"]) == 2
    assert "--lora does not apply to --kind codec" in capsys.readouterr().err
    with pytest.raises(ArgumentError, match="none of the attention projections"):
        add_lora(torch.nn.Sequential(torch.nn.Linear(4, 4)), 4)
