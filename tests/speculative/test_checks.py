"""What `ws.generate` refuses, each with one WeightstreamError that says what to change."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from conftest import hf_config, make_model

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
