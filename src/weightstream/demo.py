"""`weightstream demo`: offload a built-in Llama-shaped model that is larger than its budget, generate,
and check the tokens against the same model run fully resident."""

from __future__ import annotations

import math
import time

import torch

from .devices import resolve_device
from .errors import ArgumentError, BudgetError
from .offload import offload
from .placement.prepare import prepare
from .sizes import format_size

# Built-in shapes: random weights, no download. "gpu" is ~2.2 GB in bf16, "cpu" ~14 MB in fp32.
SHAPES = {
    "gpu": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                num_key_value_heads=4, vocab_size=32000),
    "cpu": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2, vocab_size=1000),
}


def build_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Build the built-in Llama-shaped model with random weights directly on `device`."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as err:
        raise SystemExit("the demo needs transformers: pip install 'weightstream[hf]'") from err
    torch.manual_seed(seed)
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096)
    with device:
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval().requires_grad_(False)


def _weight_bytes(model) -> int:
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _generate(
    model, prompt: torch.Tensor, new_tokens: int, device: torch.device
) -> tuple[torch.Tensor, float]:
    """Greedy generation; returns the tokens and the seconds it took."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    tokens = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                            pad_token_id=0, attention_mask=torch.ones_like(prompt))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return tokens, time.perf_counter() - start


def _gpu_memory(device: torch.device) -> str:
    if device.type != "cuda":
        return "n/a (CPU)"
    return format_size(torch.cuda.memory_allocated(device))


def run_demo(device: str | None = None, fraction: float = 0.4, new_tokens: int = 32) -> bool:
    """Run the demo; returns True when the offloaded tokens equal the resident ones.

    fraction: the GPU budget as a fraction of the model's weight bytes (the rest streams).
    Raises ArgumentError for a device that is not here, a fraction outside (0, 1] or fewer than one new
    token, and BudgetError for a fraction too small to hold what must stay on the GPU.
    """
    dev = resolve_device(device)
    if not 0 < fraction <= 1:
        raise ArgumentError(f"--fraction {fraction}: give the GPU budget as a fraction in (0, 1]")
    if new_tokens < 1:
        raise ArgumentError(f"--new-tokens {new_tokens}: generate at least 1 token")
    if dev.type == "cpu":
        print("No CUDA GPU here: running on the CPU with the synchronous backend. This checks the schedule "
              "and exactness only; speed means nothing without a GPU.")
    shape, dtype = ("gpu", torch.bfloat16) if dev.type == "cuda" else ("cpu", torch.float32)
    model = build_model(shape, dev, dtype)
    total = _weight_bytes(model)
    budget = int(total * fraction)
    try:
        prepare(model, budget, dev)  # plans only: a budget too small is refused before any generation
    except BudgetError as err:
        smallest = math.ceil(err.minimum_bytes / total * 100) / 100
        raise BudgetError(f"--fraction {fraction} gives {format_size(budget)}, too little for this model: "
                          f"give at least --fraction {smallest:.2f} ({err})", err.minimum_bytes) from None
    prompt = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(dev)
    print(f"model: Llama-shaped, {model.config.num_hidden_layers} layers, {format_size(total)} of weights "
          f"({dtype}); budget {format_size(budget)} ({fraction:.0%})")

    _generate(model, prompt, new_tokens, dev)  # warm-up: kernels, allocator, cuBLAS workspace
    reference, resident_s = _generate(model, prompt, new_tokens, dev)
    before = _gpu_memory(dev)
    handle = offload(model, gpu_memory=budget, device=dev)
    after = _gpu_memory(dev)
    _generate(model, prompt, new_tokens, dev)  # warm-up
    tokens, offloaded_s = _generate(model, prompt, new_tokens, dev)

    stats = handle.stats
    same = torch.equal(tokens, reference)
    print(f"placement: {stats}")
    print(f"GPU memory allocated: {before} resident -> {after} offloaded")
    print(f"resident:  {new_tokens / resident_s:8.1f} tokens/s")
    print(f"offloaded: {new_tokens / offloaded_s:8.1f} tokens/s "
          f"(eager generate; placement {stats.placement_kind}: {stats.groups} blocks streamed, "
          f"{format_size(stats.uva_bytes)} read in place)")
    print(f"tokens identical to the fully resident run: {'yes' if same else 'NO'}")
    handle.restore()
    return same
