"""`ws.generate` on the CPU: offloaded equals resident (tokens and logits), greedy speculative equals
plain greedy, every draft kind, greedy and seeded sampling, stopping, stats."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_model, weight_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import weightstream as ws
from weightstream.speculative import DraftModel, PromptLookup


def repetitive_prompt(seed: int, length: int = 24, alphabet: int = 6) -> torch.Tensor:
    """A prompt over a few tokens, so its n-grams repeat and prompt lookup finds drafts."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, alphabet, (1, length), generator=gen)


def plain_greedy(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones_like(ids))


def offloaded(model, fraction: float = 0.5):
    ws.offload(model, gpu_memory=int(weight_bytes(model) * fraction), device="cpu", strategy="stream")
    return model


def off_gpu_blocks(model) -> list[str]:
    """The blocks an offloaded model keeps off the GPU (streamed or read in place)."""
    handle = ws.handle_of(model)
    return [*handle.streamed_blocks, *handle.uva_blocks]


def speculate_both(ref, model, draft_for, do_sample: bool):
    """The same speculative generation (16 tokens, tree 3x3, seeded) on the resident `ref` and the
    offloaded `model`, `draft_for(target)` giving each its draft; asserts the offloaded run equals the
    resident one (tokens, logits, accepted per pass, no miss) and returns (resident, offloaded)."""
    resident, streamed = (
        ws.generate(target, repetitive_prompt(1), 16, draft=draft_for(target), width=3, depth=3,
                    do_sample=do_sample, temperature=0.9, generator=torch.Generator().manual_seed(5),
                    eos_token_id=[], output_logits=True)
        for target in (ref, model))
    assert torch.equal(streamed.tokens, resident.tokens)
    assert torch.equal(streamed.logits, resident.logits)
    assert streamed.stats.accepted == resident.stats.accepted
    assert ws.handle_of(model).stats.misses == 0
    return resident, streamed


@pytest.fixture(scope="module")
def resident_and_offloaded():
    ref = make_model("llama")
    return ref, offloaded(copy.deepcopy(ref))


DRAFTS = ["prompt-lookup", "model", None]


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("draft", DRAFTS)
def test_offloaded_speculative_generation_equals_the_resident_run(resident_and_offloaded, draft, do_sample):
    ref, model = resident_and_offloaded
    draft_model = make_model("llama", seed=0 if do_sample else 1)  # one accepts all, one almost nothing
    _, streamed = speculate_both(ref, model, lambda target: draft_model if draft == "model" else draft,
                                 do_sample)
    assert streamed.logits.shape == (16, 128) and streamed.stats.new_tokens == 16


def test_the_logits_kept_are_those_each_token_was_chosen_from(resident_and_offloaded):
    ref, _ = resident_and_offloaded
    ids = repetitive_prompt(2)
    out = ws.generate(ref, ids, 10, draft="prompt-lookup", eos_token_id=[], output_logits=True)
    assert torch.equal(out.logits.argmax(dim=-1), out.new_tokens)
    full = ref(out.tokens).logits[0, ids.shape[1] - 1:-1]  # one causal forward over the result
    assert torch.allclose(out.logits, full, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "mixtral", "gpt2"])
def test_greedy_speculative_equals_plain_greedy_for_each_architecture(arch):
    model = make_model(arch)
    ids = repetitive_prompt(3)
    want = plain_greedy(model, ids, 12)
    for draft in ("prompt-lookup", copy.deepcopy(model)):
        out = ws.generate(model, ids, 12, draft=draft, width=2, depth=4, eos_token_id=[])
        assert torch.equal(out.tokens, want)


@pytest.fixture(scope="module")
def greedy_setup():
    model = make_model("llama")
    return model, {"copy": copy.deepcopy(model), "other": make_model("llama", seed=7)}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), length=st.integers(1, 20), alphabet=st.integers(2, 128),
       width=st.integers(1, 3), depth=st.integers(1, 5),
       draft=st.sampled_from(["prompt-lookup", "copy", "other"]))
def test_greedy_speculative_equals_plain_greedy_over_prompts_and_trees(greedy_setup, seed, length, alphabet,
                                                                       width, depth, draft):
    model, drafts = greedy_setup
    ids = repetitive_prompt(seed, length, alphabet)
    out = ws.generate(model, ids, 10, draft=drafts.get(draft, draft), width=width, depth=depth,
                      eos_token_id=[])
    assert torch.equal(out.tokens, plain_greedy(model, ids, 10))


def test_a_draft_that_is_the_model_has_every_token_accepted():
    model = make_model("llama")
    out = ws.generate(model, repetitive_prompt(4), 21, draft=copy.deepcopy(model), width=1, depth=4,
                      eos_token_id=[])
    assert out.stats.accepted == (4,) * 4  # 1 from the prefill, then 4 passes of 4 drafted + 1
    assert out.stats.passes == 4 and out.stats.tokens_per_pass == 5.0 and out.stats.draft == "model"


def test_generation_stops_after_the_end_token_and_at_max_new_tokens():
    model = make_model("llama")
    ids = repetitive_prompt(5)
    want = plain_greedy(model, ids, 12)[0, ids.shape[1]:]
    eos = int(want[6])
    first = int((want == eos).nonzero()[0])
    out = ws.generate(model, ids, 12, draft=copy.deepcopy(model), width=2, depth=3, eos_token_id=eos)
    assert out.new_tokens.tolist() == want[: first + 1].tolist()
    hf = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0,
                        attention_mask=torch.ones_like(ids))
    assert torch.equal(out.tokens, hf)
    for n in (1, 2, 7):
        out = ws.generate(model, ids, n, draft=copy.deepcopy(model), width=2, depth=3, eos_token_id=[])
        assert out.new_tokens.tolist() == want[:n].tolist() and out.stats.new_tokens == n


def test_seeded_sampling_repeats_and_follows_its_seed():
    model = make_model("llama")
    ids = repetitive_prompt(6)

    def run(seed):
        return ws.generate(model, ids, 12, draft=PromptLookup(), do_sample=True, top_k=20, top_p=0.95,
                           generator=torch.Generator().manual_seed(seed), eos_token_id=[]).tokens

    assert torch.equal(run(1), run(1))
    assert not all(torch.equal(run(1), run(seed)) for seed in (2, 3, 4))


def test_sampling_settings_not_given_are_the_models_generation_configs():
    """As in transformers' generate: temperature, top_k and top_p not given come from the model's
    generation_config (a sampled run with them set there equals one given them), and given ones win."""
    model = make_model("llama")
    ids = repetitive_prompt(6)

    def run(**kwargs):
        return ws.generate(model, ids, 12, draft=PromptLookup(), do_sample=True,
                           generator=torch.Generator().manual_seed(5), eos_token_id=[], **kwargs).tokens

    plain = run()
    given = run(temperature=0.5, top_k=3, top_p=0.9)
    assert not torch.equal(plain, given)
    model.generation_config.temperature, model.generation_config.top_k = 0.5, 3
    model.generation_config.top_p = 0.9
    assert torch.equal(run(), given)
    assert torch.equal(run(temperature=1.0, top_k=50, top_p=1.0), plain)  # transformers' defaults


def test_stats_count_passes_and_the_bar_shows_tokens_per_second(capsys):
    model = make_model("llama")
    out = ws.generate(model, repetitive_prompt(7), 9, draft=DraftModel(copy.deepcopy(model)), width=2,
                      depth=2, eos_token_id=[], progress=True)
    stats = out.stats
    assert stats.passes == len(stats.accepted) and stats.new_tokens == 9 and stats.tree_tokens == 5
    assert 1 + sum(stats.accepted) + stats.passes >= 9 > sum(stats.accepted[:-1]) + stats.passes  # last cut
    assert stats.accepted_per_pass == sum(stats.accepted) / stats.passes and stats.tokens_per_second > 0
    assert stats.verify_ms > 0 and stats.draft_ms > 0 and "verify passes of 5 tokens" in str(stats)
    assert "tok_s" in capsys.readouterr().err


def test_no_draft_decodes_one_token_per_pass():
    model = make_model("llama")
    ids = repetitive_prompt(8)
    out = ws.generate(model, ids, 6, draft=None, eos_token_id=[])
    assert out.stats.tree_tokens == 1 and out.stats.accepted == (0,) * 5
    assert torch.equal(out.tokens, plain_greedy(model, ids, 6))


@pytest.mark.parametrize("form", ["int", "list", "0-d tensor", "1-d tensor"])
def test_the_stop_token_is_taken_in_every_form_transformers_takes(form):
    """eos_token_id as an int, a list, or a tensor (a 0-d tensor raised a TypeError): generation ends
    at the first token greedy decoding reaches that is a stop token."""
    ref = make_model("llama")
    ids = repetitive_prompt(3)
    free = ws.generate(ref, ids, 8, draft="prompt-lookup", eos_token_id=[], progress=False).new_tokens
    stop = int(free[2])
    given = {"int": stop, "list": [stop], "0-d tensor": torch.tensor(stop),
             "1-d tensor": torch.tensor([stop])}[form]
    out = ws.generate(ref, ids, 8, draft="prompt-lookup", eos_token_id=given, progress=False).new_tokens
    first = free.tolist().index(stop)
    assert torch.equal(out, free[: first + 1])


def test_a_model_whose_forward_fails_over_the_static_cache_is_named_in_a_clear_error(monkeypatch):
    """transformers' DeepSeek-V2 fails inside its attention over a static cache and a 4-D mask, with a
    bare shape error; generate says which model failed, with what, and what to use instead. The
    library's own errors pass through as they are."""
    from weightstream.errors import ArgumentError, OffloadStateError

    ref = make_model("llama")
    ids = repetitive_prompt(1)

    def fails(*args, **kwargs):
        raise RuntimeError("The size of tensor a (4) must match the size of tensor b (8)")

    monkeypatch.setattr(ref.model, "forward", fails)
    with pytest.raises(ArgumentError, match=r"LlamaForCausalLM's forward failed over the static KV cache.*"
                                            r"size of tensor a \(4\).*model\.generate"):
        ws.generate(ref, ids, 4, progress=False)

    def refused(*args, **kwargs):
        raise OffloadStateError("written outside")

    monkeypatch.setattr(ref.model, "forward", refused)
    with pytest.raises(OffloadStateError, match="written outside"):
        ws.generate(ref, ids, 4, progress=False)
