"""Shared fixtures: tiny random Hugging Face models built from configs (no downloads)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def hf_config(arch: str):
    """A tiny config of the given architecture (random weights, a few hundred KiB)."""
    import transformers as tf

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=None)
    if arch == "mixtral":
        return tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if arch == "gpt2":
        return tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=4, n_head=4, n_positions=128)
    raise ValueError(arch)


ARCHS = ["llama", "qwen2", "mistral", "gpt2", "mixtral"]


def make_model(arch: str, seed: int = 0, dtype=torch.float32):
    """A tiny random model in eval mode without gradients."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch)).to(dtype)
    return model.eval().requires_grad_(False)


def rss_bytes() -> int:
    """This process's resident set size now, in bytes (/proc/self/statm)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_interpreted(folder: Path, check: str) -> subprocess.CompletedProcess:
    """Run the Python statement `check` in a fresh Python with TRITON_INTERPRET=1 (Triton's interpreter
    runs a kernel's own code on the CPU), with `folder` (where the interpreted test module lies) and the
    package's src/ on its path."""
    src = Path(__file__).parents[1] / "src"
    path = os.pathsep.join([str(folder), str(src), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    return subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=600)


def rss_while(call):
    """Run `call()` while a thread samples the resident set every 2 ms; return (its result, the resident
    set before, its highest sample, the resident set after), sizes in bytes."""
    import threading
    import time

    before = rss_bytes()
    peak, stop = [before], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = call()
    finally:
        stop.set()
        sampler.join()
    return result, before, peak[0], rss_bytes()


def wide_moe(layers: int = 2, seed: int = 0):
    """A Qwen3-MoE with 32 experts, top 4, wide enough (hidden 256) for its routing statistics to mean
    something; eval mode, no grads."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=256, moe_intermediate_size=32,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=64, num_experts=32, num_experts_per_tok=4)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)


def weight_bytes(model) -> int:
    """Bytes of the model's distinct parameters and buffers."""
    seen = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in seen.values())


def in_order_copies(stats, forwards: int) -> int:
    """Copies a fresh offloaded model makes over `forwards` forwards in module order (stats: its
    `OffloadStats`, for groups and slots). Written out, not taken from the schedule: the first forward
    copies every group, and its last releases copy the next forward's first group of each slot that
    more than one group shares; every later forward copies the groups of those slots (a group alone
    in its slot stays there)."""
    n, k = stats.groups, stats.slots
    if forwards <= 0 or n == 0:
        return 0
    if k >= n:
        return n
    alone = max(0, 2 * k - n)  # slots s with s + k >= n hold one group
    return n + (k - alone) + (forwards - 1) * (n - alone)


def state_copy(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def checkpoint(tmp_path):
    """A tiny Llama checkpoint folder with a word-level tokenizer over 128 tokens and a chat template:
    (folder, tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(127)} | {"[UNK]": 127}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="w0",
                                        pad_token="w0")
    tokenizer.chat_template = "{% for m in messages %}w1 {{ m['content'] }} w2{% endfor %}"
    tokenizer.save_pretrained(tmp_path)
    make_model("llama").save_pretrained(tmp_path, max_shard_size="60KB")
    return tmp_path, tokenizer


@pytest.fixture
def twin():
    """Return (reference, copy) of a tiny model: the copy gets offloaded, the reference stays resident."""

    def build(arch: str = "llama", seed: int = 0, dtype=torch.float32):
        ref = make_model(arch, seed, dtype)
        return ref, copy.deepcopy(ref)

    return build


BENCH_WS = ["ws-stream", "ws-uva", "ws-auto"]
BENCH_PHASES = ["decode-b1", "prefill-8"]


@pytest.fixture(scope="session")
def bench_stored(tmp_path_factory) -> str:
    """Path of the JSON written by one tiny CPU `weightstream bench` run (eager only; optional methods
    included so a missing import is recorded). Shared by the tests of the bench package's modules."""
    from weightstream.bench import run_suite

    path = str(tmp_path_factory.mktemp("bench") / "suite_tiny.json")
    methods = ["resident", *BENCH_WS, "accelerate-cpu_offload", "diffusers-group"]
    run_suite("tiny", [0.5, "0.8"], BENCH_PHASES, methods, ["eager"], 2, "cpu", path, command="test")
    return path


@pytest.fixture
def bench_doc(bench_stored) -> dict:
    """A fresh copy of that run's document (tests may change it)."""
    import json

    with open(bench_stored) as f:
        return json.load(f)


class Boundaries:
    """An engine whose ops do nothing: a resident model with the schedule ops at the blocks' edges."""

    def wait(self, group: int) -> None: ...
    def release(self, group: int) -> None: ...
    def unalias(self, tensors: list) -> list:
        return tensors  # no staging slots: nothing to copy

    def abort(self) -> None: ...
    def on_graph_event(self, synchronize: bool = False) -> None: ...


def with_boundaries(model, names: list[str] | None = None):
    """`model` (resident) with the tensors of its blocks (those named, default all) passed through the
    (idle) ops, as offloaded: the reference for compiled models whose resident graph fuses across
    block edges (docs/exactness.md)."""
    from weightstream.engine import ops
    from weightstream.engine.streamed import _streamed_class
    from weightstream.placement.blocks import find_blocks

    model._boundaries = Boundaries()  # the registry holds engines weakly
    engine_id = ops.register(model._boundaries)
    blocks = [b for b in find_blocks(model) if names is None or b.name in names]
    for group, block in enumerate(blocks):
        block.module._ws_engine_id, block.module._ws_group = engine_id, group
        block.module.__class__ = _streamed_class(type(block.module))
    return model
