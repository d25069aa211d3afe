"""What `ws.generate` refuses, each with one WeightstreamError that says what to change."""

from __future__ import annotations

import re

import pytest
import torch
import transformers as tf
from conftest import hf_config, make_model
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import weightstream as ws
from weightstream.errors import ArgumentError, BudgetError, WeightstreamError
from weightstream.speculative.cache import kv_bytes
from weightstream.speculative.checks import generation_bytes

IDS = torch.tensor([[1, 2, 3, 1, 2]])


@pytest.fixture(scope="module")
def model():
    return make_model("llama")


def test_a_draft_with_another_vocabulary_is_refused(model):
    config = hf_config("llama")
    config.vocab_size = 100
    draft = tf.LlamaForCausalLM(config).eval()
    with pytest.raises(ArgumentError, match="vocabulary has 100 tokens and the model's 128.*tokenizer"):
        ws.generate(model, IDS, 4, draft=draft)


@pytest.mark.parametrize("not_a_causal_lm", ["decoder without a head", "linear", "encoder-decoder"])
def test_a_model_that_is_not_a_causal_lm_is_refused(not_a_causal_lm, model):
    if not_a_causal_lm == "decoder without a head":
        other = tf.LlamaModel(hf_config("llama"))
    elif not_a_causal_lm == "linear":
        other = torch.nn.Linear(4, 4)
    else:
        other = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=128, d_model=32, d_ff=64, num_layers=1,
                                                          num_heads=2, d_kv=16))
    with pytest.raises(ArgumentError, match="is not a causal LM.*AutoModelForCausalLM"):
        ws.generate(other, IDS, 4)
    with pytest.raises(ArgumentError, match="the draft .* is not a causal LM"):
        ws.generate(model, IDS, 4, draft=other)


def test_a_model_with_layers_other_than_full_or_sliding_attention_is_refused():
    config = hf_config("qwen2")
    config.layer_types = ["full_attention", "linear_attention"] * 2
    model = tf.Qwen2ForCausalLM(hf_config("qwen2")).eval()
    model.config = config
    with pytest.raises(ArgumentError, match="linear_attention.*full_attention and sliding_attention only"):
        ws.generate(model, IDS, 4)
    with pytest.raises(ArgumentError, match="the draft .*linear_attention"):
        ws.generate(make_model("qwen2"), IDS, 4, draft=model)


def test_an_attention_without_4d_masks_is_refused():
    model = make_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ArgumentError, match="'flash_attention_2', which takes no 4-D tree mask.*'sdpa'"):
        ws.generate(model, IDS, 4)


def test_caches_that_do_not_fit_the_memory_given_say_how_much_they_need(model):
    need = generation_bytes(model, None, IDS.shape[1] + 20 - 1 + 25, 25, 128)
    with pytest.raises(BudgetError, match="need .* cache_memory has 1000 B") as caught:
        ws.generate(model, IDS, 20, width=4, depth=6, cache_memory=1000)
    assert caught.value.minimum_bytes == need > kv_bytes(model.config, IDS.shape[1] + 20, model.dtype)
    assert ws.generate(model, IDS, 20, width=4, depth=6, cache_memory=need).stats.new_tokens >= 1


def test_a_generation_past_the_models_positions_is_refused(model):
    with pytest.raises(ArgumentError, match="past the model's 128 .*lower max_new_tokens or depth"):
        ws.generate(model, IDS, 120, depth=6)


@pytest.mark.parametrize("kwargs, message", [
    (dict(draft="medusa"), "draft='medusa': give 'prompt-lookup', 'self'"),
    (dict(draft=3), "draft of type int"),
    (dict(width=0), "tree width=0"),
    (dict(depth=-1), "tree depth=-1"),
    (dict(max_new_tokens=0), "generate at least 1 token"),
    (dict(do_sample=True, temperature=0.0), "temperature=0.0"),
    (dict(input_ids=torch.tensor([[1, 2], [3, 4]])), "batch 1"),
    (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "non-empty prompt"),
])
def test_bad_arguments_get_one_error_each(model, kwargs, message):
    args = dict(input_ids=IDS, max_new_tokens=4) | kwargs
    with pytest.raises(WeightstreamError, match=message):
        ws.generate(model, **args)


def repeating_prompt(length: int = 12, alphabet: int = 6, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, alphabet, (1, length), generator=torch.Generator().manual_seed(seed))


def transformers_greedy(model, ids: torch.Tensor, n: int, **kwargs) -> torch.Tensor:
    """transformers' own greedy generation of `n` tokens, no stop token unless given."""
    kwargs = dict(eos_token_id=None, min_new_tokens=n) | kwargs
    return model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0,
                          attention_mask=torch.ones_like(ids), **kwargs)


# each a setting of model.generation_config under which transformers' generate picks other tokens
# than plain greedy decoding for the model fixture's prompt (asserted below, so none is vacuous)
TOKEN_CHANGING_SETTINGS = [
    ("repetition_penalty", 1.8), ("encoder_repetition_penalty", 1.8), ("no_repeat_ngram_size", 2),
    ("encoder_no_repeat_ngram_size", 1), ("suppress_tokens", "first"), ("begin_suppress_tokens", "first"),
    ("bad_words_ids", "first"), ("sequence_bias", "first"), ("forced_eos_token_id", 5),
    ("forced_bos_token_id", 5), ("num_beams", 3), ("remove_invalid_values", True),
]


@pytest.fixture(scope="module")
def greedy_tokens(model):
    return transformers_greedy(model, repeating_prompt(), 8)[0, 12:].tolist()


def setting_value(name: str, value, greedy: list[int]):
    """The setting's value, with "first" standing for the first token plain greedy decoding picks."""
    if value != "first":
        return value
    return {"suppress_tokens": [greedy[0]], "begin_suppress_tokens": [greedy[0]],
            "bad_words_ids": [[greedy[0]]], "sequence_bias": {(greedy[0],): -100.0}}[name]


@pytest.mark.parametrize("name, value", TOKEN_CHANGING_SETTINGS, ids=[n for n, _ in TOKEN_CHANGING_SETTINGS])
def test_generation_config_settings_that_change_tokens_are_refused(model, greedy_tokens, monkeypatch, name,
                                                                   value):
    """A generation_config setting speculative generation does not apply is refused, by name and value,
    with the two ways out; transformers' generate with the same setting picks other tokens, except
    remove_invalid_values, whose effect needs a logit that is not finite."""
    ids = repeating_prompt(1 if name == "forced_bos_token_id" else 12)  # it acts after one token only
    plain = transformers_greedy(model, ids, 8)
    monkeypatch.setattr(model.generation_config, name, setting_value(name, value, greedy_tokens))
    if name != "remove_invalid_values":
        assert not torch.equal(transformers_greedy(model, ids, 8), plain)
    with pytest.raises(ArgumentError, match=rf"generation_config sets {name}=.*model\.generate\(\), or set "
                                            rf"model\.generation_config\.{name} = "):
        ws.generate(model, ids, 8, eos_token_id=[])


def test_every_setting_is_named_at_once_and_neutral_values_give_transformers_tokens(model, monkeypatch):
    ids = repeating_prompt()
    monkeypatch.setattr(model.generation_config, "repetition_penalty", 1.3)
    monkeypatch.setattr(model.generation_config, "no_repeat_ngram_size", 2)
    with pytest.raises(ArgumentError, match=r"repetition_penalty=1\.3, no_repeat_ngram_size=2.*"
                                            r"repetition_penalty = 1\.0; .*no_repeat_ngram_size = 0"):
        ws.generate(model, ids, 8, eos_token_id=[])
    for name, neutral in [("repetition_penalty", 1.0), ("no_repeat_ngram_size", 0), ("suppress_tokens", []),
                          ("num_beams", 1), ("guidance_scale", 1.0)]:
        monkeypatch.setattr(model.generation_config, name, neutral)
    out = ws.generate(model, ids, 8, eos_token_id=[], width=2, depth=3)
    assert torch.equal(out.tokens, transformers_greedy(model, ids, 8))


def test_settings_acting_on_the_stop_token_are_refused_only_where_there_is_one(
        model, greedy_tokens, monkeypatch):
    """min_new_tokens and min_length hold a stop token back, exponential_decay_length_penalty brings one
    forward: with a stop token transformers' tokens change and generate refuses; without one they are
    transformers' own."""
    ids = repeating_prompt()
    early, absent = greedy_tokens[1], next(t for t in range(128) if t not in greedy_tokens)
    plain = transformers_greedy(model, ids, 8)  # (transformers refuses the decay without a stop token)
    for name, value, stop in [("min_new_tokens", 4, early), ("min_length", 12 + 4, early),
                              ("exponential_decay_length_penalty", (1, 50.0), absent)]:
        def stopping(stop=stop):  # min_new_tokens not given, so that the generation_config's applies
            return model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=stop,
                                  attention_mask=torch.ones_like(ids))

        with monkeypatch.context() as patch:
            want = stopping()
            patch.setattr(model.generation_config, name, value)
            assert not torch.equal(stopping(), want)
            with pytest.raises(ArgumentError, match=rf"{name}={re.escape(repr(value))}"):
                ws.generate(model, ids, 8, eos_token_id=stop)
            no_stop = ws.generate(model, ids, 8, eos_token_id=[])  # nothing to hold back or bring forward
            assert torch.equal(no_stop.tokens, plain)
    with monkeypatch.context() as patch:
        patch.setattr(model.generation_config, "min_length", 12)  # the prompt reaches it already
        assert ws.generate(model, ids, 8, eos_token_id=early).new_tokens.tolist() == greedy_tokens[:2]


@pytest.mark.parametrize("name, value", [("min_p", 0.2), ("typical_p", 0.5), ("epsilon_cutoff", 0.01),
                                         ("eta_cutoff", 0.01), ("top_h", 0.5)])
def test_samplers_that_generate_does_not_apply_are_refused_when_sampling(model, monkeypatch, name, value):
    ids = repeating_prompt()
    monkeypatch.setattr(model.generation_config, name, value)
    with pytest.raises(ArgumentError, match=f"{name}={value}"):
        ws.generate(model, ids, 4, do_sample=True, generator=torch.Generator().manual_seed(0))
    # transformers applies them only when sampling: greedy generation is unchanged
    assert torch.equal(ws.generate(model, ids, 4, eos_token_id=[]).tokens, transformers_greedy(model, ids, 4))


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_p=-0.2), r"top_p=-0\.2: .*\[0, 1\]"),
    (dict(top_p=1.5), r"top_p=1\.5"),
    (dict(top_p="0.9"), r"top_p='0\.9'"),
    (dict(top_k=-1), r"top_k=-1: .*at least 1 \(0 or None: no top-k\)"),
    (dict(top_k=2.5), r"top_k=2\.5"),
    (dict(top_k=True), r"top_k=True"),
    (dict(temperature=-1.0), r"temperature=-1\.0"),
    (dict(temperature=float("nan")), r"temperature=nan"),
    (dict(temperature="hot"), r"temperature='hot'"),
])
def test_sampling_arguments_transformers_refuses_are_refused(model, kwargs, message):
    with pytest.raises(ArgumentError, match=message):
        ws.generate(model, IDS, 4, do_sample=True, generator=torch.Generator().manual_seed(0), **kwargs)


def test_top_k_zero_is_no_top_k_as_in_transformers(model):
    ids = repeating_prompt()

    def sample(**kwargs):
        return ws.generate(model, ids, 8, do_sample=True, generator=torch.Generator().manual_seed(3),
                           eos_token_id=[], width=2, depth=2, **kwargs).tokens

    vocab = model.config.vocab_size  # top-k over the whole vocabulary keeps every token: no top-k
    assert torch.equal(sample(top_k=0), sample(top_k=vocab))
    assert torch.equal(sample(top_k=0, top_p=0.9), sample(top_k=vocab, top_p=0.9))


def tiny(config, seed: int = 0):
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(config).float().eval().requires_grad_(False)


def longrope_phi3():
    """A tiny Phi-3 whose LongRoPE factors switch from short (1) to long (8) past 16 positions."""
    half = 8  # head_dim 16 / 2
    config = tf.Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                           pad_token_id=0, eos_token_id=1, bos_token_id=1, initializer_range=0.2,
                           original_max_position_embeddings=16,
                           rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                            "short_factor": [1.0] * half, "long_factor": [8.0] * half,
                                            "original_max_position_embeddings": 16})
    return tiny(config)


@pytest.fixture(scope="module")
def phi3():
    return longrope_phi3()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.integers(1, 24), new=st.integers(1, 10), depth=st.integers(0, 3),
       seed=st.integers(0, 1000))
@example(prompt=12, new=10, depth=3, seed=0).via("crosses")
@example(prompt=12, new=10, depth=0, seed=0).via("crosses, one token a pass")
@example(prompt=4, new=9, depth=3, seed=0).via("short factors throughout")
@example(prompt=20, new=10, depth=3, seed=0).via("long factors throughout")
def test_longrope_is_refused_where_the_generation_crosses_its_switch_and_exact_elsewhere(phi3, prompt, new,
                                                                                        depth, seed):
    """transformers' Phi-3 computes the whole cache again with the long factors once the sequence passes
    original_max_position_embeddings; a generation that stays on one side of it equals transformers'."""
    ids = torch.randint(0, 128, (1, prompt), generator=torch.Generator().manual_seed(seed))
    draft = None if depth == 0 else "prompt-lookup"
    run = dict(draft=draft, width=2, depth=max(depth, 1), eos_token_id=[])
    if prompt <= 16 < prompt + new + depth:
        with pytest.raises(ArgumentError, match="LongRoPE.*switch at 16 positions.*model.generate"):
            ws.generate(phi3, ids, new, **run)
    else:
        assert torch.equal(ws.generate(phi3, ids, new, **run).tokens, transformers_greedy(phi3, ids, new))


def test_longrope_crossing_its_switch_changes_transformers_tokens(phi3):
    """The refusal is not vacuous: across the switch, one token a pass over a static cache (what
    draft=None would run) gives other tokens than transformers' generate."""
    from weightstream.speculative.cache import TreeCache
    from weightstream.speculative.tree import causal_mask
    from weightstream.speculative.verify import TreeForward

    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    want = transformers_greedy(phi3, ids, 16)[0, 12:].tolist()
    forward = TreeForward(phi3, TreeCache(2, 28), torch.device("cpu"), torch.float32)
    tokens = [int(forward.prefill(ids[0])[-1].argmax())]
    while len(tokens) < 16:
        at = 12 + len(tokens) - 1
        logits = forward.run(torch.tensor(tokens[-1:]), torch.tensor([at]), torch.tensor([at]),
                             causal_mask(at, 1, 28))
        tokens.append(int(logits[-1].argmax()))
    assert tokens != want


def test_gpt_neo_local_attention_is_refused_and_global_attention_is_exact():
    local = tiny(tf.GPTNeoConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, window_size=4,
                                 attention_types=[[["global", "local"], 1]], max_position_embeddings=128))
    ids = repeating_prompt()
    assert not torch.equal(local(ids).logits[0, -1], static_prefill_logits(local, ids))  # not vacuous
    for draft in (None, "prompt-lookup", "self"):
        with pytest.raises(ArgumentError, match=r"local attention layers \(attention_layers \['global', "
                                                r"'local'\]\).*model\.generate"):
            ws.generate(local, ids, 8, draft=draft, eos_token_id=[])
    full = tiny(tf.GPTNeoConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, window_size=4,
                                attention_types=[[["global"], 2]], max_position_embeddings=128))
    for draft in (None, "prompt-lookup"):
        out = ws.generate(full, ids, 12, draft=draft, width=2, depth=3, eos_token_id=[])
        assert torch.equal(out.tokens, transformers_greedy(full, ids, 12))


def static_prefill_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The last logits of a prefill over a static cache longer than the prompt, as generate runs it."""
    from weightstream.speculative.cache import TreeCache
    from weightstream.speculative.verify import TreeForward

    cache = TreeCache(model.config.num_hidden_layers, ids.shape[1] + 16)
    return TreeForward(model, cache, torch.device("cpu"), torch.float32).prefill(ids[0])[-1]


ALIBI_MODELS = {
    "mpt": lambda: tf.MptConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, max_seq_len=128,
                                initializer_range=0.2),
    "bloom": lambda: tf.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4),
    "falcon": lambda: tf.FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, alibi=True, new_decoder_architecture=False,
                                      multi_query=True),
}


@pytest.mark.parametrize("arch", ALIBI_MODELS)
def test_alibi_models_are_refused_for_trees(arch):
    model = tiny(ALIBI_MODELS[arch](), seed=2)
    ids = repeating_prompt(alphabet=4)
    for draft in ("prompt-lookup", "self"):
        with pytest.raises(ArgumentError, match=r"ALiBi attention biases by cache slot.*draft=None .*"
                                                r"model\.generate"):
            ws.generate(model, ids, 8, draft=draft, width=3, depth=3, eos_token_id=[])
    if arch == "mpt":  # one token a pass sits at the slot of its position: exact
        out = ws.generate(model, ids, 16, draft=None, eos_token_id=[])
        assert torch.equal(out.tokens, transformers_greedy(model, ids, 16))
    else:  # their attention takes no static cache: said, not a bare ValueError
        with pytest.raises(ArgumentError, match=r"forward failed over the static KV cache .*\(ValueError: "):
            ws.generate(model, ids, 8, draft=None, eos_token_id=[])


def test_mpt_tree_verification_would_change_its_tokens():
    """The refusal is not vacuous: MPT's logits of a drafted node verified in a tree differ from those of
    the same tokens run one at a time."""
    from weightstream.speculative.cache import TreeCache
    from weightstream.speculative.tree import causal_mask
    from weightstream.speculative.verify import TreeForward

    model = tiny(ALIBI_MODELS["mpt"](), seed=2)
    ids = repeating_prompt(alphabet=4)[0]
    forward = TreeForward(model, TreeCache(2, 24), torch.device("cpu"), torch.float32)
    forward.prefill(ids[:8])
    # a tree of a root and two alternatives at depth 1: the second sits at slot 10, its position is 9
    mask = causal_mask(8, 3, 24)
    mask[2, 9] = False
    tree = forward.run(ids[8:11], torch.tensor([8, 9, 9]), torch.arange(8, 11), mask)
    chain = forward.run(torch.stack([ids[8], ids[10]]), torch.tensor([8, 9]), torch.arange(8, 10),
                        causal_mask(8, 2, 24))
    assert not torch.allclose(tree[2], chain[1], atol=1e-4)


@pytest.mark.parametrize("error", [ValueError("too many values to unpack (expected 2)"), AssertionError(),
                                   KeyError("past_key_values"), TypeError("unexpected keyword")])
def test_any_failure_of_the_models_forward_in_the_prefill_is_said_clearly(monkeypatch, error):
    model = make_model("llama")

    def fails(*args, **kwargs):
        raise error

    monkeypatch.setattr(model.model, "forward", fails)
    with pytest.raises(ArgumentError, match=rf"LlamaForCausalLM's forward failed over the static KV cache .*"
                                            rf"\({type(error).__name__}.*model\.generate"):
        ws.generate(model, IDS, 4, progress=False)


def test_a_model_whose_attention_asserts_on_a_static_cache_is_named_in_a_clear_error():
    model = tiny(tf.XLMConfig(vocab_size=128, emb_dim=64, n_layers=2, n_heads=4, is_decoder=True,
                              causal=True))
    with pytest.raises(ArgumentError, match=r"XLMWithLMHeadModel's forward failed .*\(AssertionError\)"):
        ws.generate(model, IDS, 4, draft=None)
