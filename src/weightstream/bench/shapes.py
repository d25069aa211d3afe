"""The bench's model shapes: the built-in planning shapes (`weightstream/placement/shapes.py`) plus test-sized
ones, each with the model kind that builds it with random weights, makes its inputs and runs it.

A new shape of an existing kind is one `Shape` entry in `SHAPES`. A new kind of model (a diffusion
transformer, a causal LM with fp8 or int4 weights) is a class with `ModelKind`'s members in a file of
its own, plus the `Shape` entries that use it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ..errors import ArgumentError
from ..placement.plan import check_routing_skew as check_skew_number
from ..placement.shapes import SHAPES as PLANNING_SHAPES
from ..sizes import format_size
from .causal_lm import CAUSAL_LM, routing_skew_text, skew_routing
from .diffusion import SHAPE_FIELDS as DIFFUSION_SHAPES
from .diffusion import Diffusion
from .memory import module_bytes
from .phases import Phase
from .quantized_lm import QuantizedLM
from .seq2seq_lm import T5_XXL, TINY_T5_ENCDEC, Seq2SeqLM

HEADROOM_BYTES = 6 * 2**30  # GPU memory kept free for activations when deciding whether a shape fits


class ModelKind(Protocol):
    """How the bench builds, feeds and runs one kind of model (e.g. `causal_lm.CausalLM`)."""

    name: str
    dtype_name: str  # what the weights are, as recorded in the document's `shape.dtype`

    def build(self, fields: dict, device: torch.device, seed: int) -> nn.Module:
        """The model with random weights on `device`, eval mode, no grads."""

    def meta(self, fields: dict) -> nn.Module:
        """The same model on the meta device (sizes without memory)."""

    def inputs(self, model: nn.Module, phases: list[Phase], device: torch.device,
               seed: int) -> dict[str, torch.Tensor]:
        """One fixed input tensor per phase name (one tensor: CUDA-graph capture copies it)."""

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """One forward; the output compared bit for bit against the reference."""

    # optional members: `generate(model, x, new_tokens)` (the `generate-N` phase), `resolve(fields,
    # phase)` (a diffusion step's tokens), `link_bytes(handle)` (bytes one forward moves under an offload
    # handle, where not all its streamed groups: an encoder-decoder's decoder step), `cuda_only` and
    # `requires` (a module to import), checked by `check_shape` before anything is built


# config fields that give a mixture of experts' expert count
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class Shape:
    """A named model shape: config fields (with `model_type`), its model kind, and a note on how it
    differs from the published model (recorded with every result). A mixture of experts may carry a
    synthetic routing skew (`routing_skew`, a Zipf exponent; `causal_lm.skew_routing`, seeded by
    `routing_seed`), applied when it is built."""

    name: str
    fields: dict
    model: ModelKind = CAUSAL_LM
    note: str = ""
    routing_skew: float | None = None
    routing_seed: int = 0

    @property
    def moe(self) -> bool:
        """Whether the shape is a mixture of experts (its config names an expert count)."""
        return any(self.fields.get(f) for f in EXPERT_FIELDS)

    def record(self) -> dict:
        """The document's `shape` entry: name, config fields, dtype (and the note, where there is one);
        for a mixture of experts also `routing` (the synthetic routing skew, or that there is none) and
        `routing_skew` (the Zipf exponent, None without one); `attention` where a causal LM runs eager
        attention instead of SDPA (its class has no SDPA path)."""
        routing = ({"routing": routing_skew_text(self.routing_skew, self.routing_seed),
                    "routing_skew": self.routing_skew} if self.moe else {})
        attention = getattr(self.model, "attention", None)
        eager = attention is not None and attention(self.fields) != "sdpa"
        return {"name": self.name, **self.fields, "dtype": self.model.dtype_name,
                **({"note": self.note} if self.note else {}), **routing,
                **({"attention": "eager (this model class has no SDPA attention)"} if eager else {})}


# A test-sized Llama, local to the bench (not a planning shape): CPU smoke runs of the whole harness.
TINY = dict(
    model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256,
)
TINY_MOE = dict(  # the same, as a Mixtral: expert weights fused per block, routing by the input
    model_type="mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=2,
)
# Wide enough that lossless compression pays (TINY's 64-wide tensors are mostly per-tensor overhead:
# its compressed groups would not fit a landing buffer under 0.95 of the slot): ws-auto-compress on CPU
TINY_WIDE = dict(TINY, hidden_size=256, intermediate_size=512)
# what a planning shape's random-weight build leaves out of the published model
NOTES = {
    "gpt-oss-20b": "experts in bf16, not the published MXFP4 (4.25 bits a weight, whose kernels this build "
                   "does not use): about 3.8x the published expert bytes",
    "qwen3-235b-a22b": "470 GB of bf16 weights: plan only (`weightstream plan qwen3-235b-a22b`) where host "
                       "memory cannot hold them",
}
SHAPES = {
    **{name: Shape(name, fields, note=NOTES.get(name, "")) for name, fields in PLANNING_SHAPES.items()},
    "tiny": Shape("tiny", TINY),
    "tiny-moe": Shape("tiny-moe", TINY_MOE),
    "tiny-wide": Shape("tiny-wide", TINY_WIDE),
    **{name: Shape(name, fields, Diffusion(fields)) for name, fields in DIFFUSION_SHAPES.items()},
    # quantized weights streamed as stored (quantized_lm.py; formerly benchmarks/bench_quant.py)
    "llama-3-8b-fp8": Shape("llama-3-8b-fp8", PLANNING_SHAPES["llama-3-8b"], QuantizedLM("fp8")),
    "llama-3-8b-int4": Shape("llama-3-8b-int4", PLANNING_SHAPES["llama-3-8b"], QuantizedLM("int4")),
    "tiny-fp8": Shape("tiny-fp8", TINY, QuantizedLM("fp8")),
    "tiny-int4": Shape("tiny-int4", TINY, QuantizedLM("int4")),
    # encoder-decoder decoder steps (seq2seq_lm.py; formerly benchmarks/bench_encdec.py)
    "t5-xxl": Shape("t5-xxl", T5_XXL, Seq2SeqLM(T5_XXL)),
    "tiny-t5-encdec": Shape("tiny-t5-encdec", TINY_T5_ENCDEC, Seq2SeqLM(TINY_T5_ENCDEC)),
}
CPU_SHAPES = tuple(name for name in SHAPES if name.startswith("tiny"))  # what a CPU smoke run may build


def resolve_phase(shape: Shape, phase: Phase) -> Phase:
    """The phase as this shape runs it: a model kind with a `resolve` (diffusion) fills in its tokens."""
    resolve = getattr(shape.model, "resolve", None)
    return resolve(shape.fields, phase) if resolve is not None else phase


def check_shape(shape: Shape, device: torch.device) -> None:
    """Raise ValueError when `shape` cannot run on `device` here: its model kind needs CUDA or a module
    that does not import (the message says what to change)."""
    if getattr(shape.model, "cuda_only", False) and device.type != "cuda":
        raise ValueError(f"--shape {shape.name} needs a CUDA device ({shape.model.dtype_name}); on the CPU "
                         "use --shape tiny-fp8 for quantized weights")
    module = getattr(shape.model, "requires", None)
    if module:
        from .methods import import_error

        if import_error(module):
            raise ValueError(f"--shape {shape.name}: {import_error(module)}")
    check_host_memory(shape, device)


def check_host_memory(shape: Shape, device: torch.device) -> None:
    """Raise ValueError when `shape`'s weights would be built on the CPU (they do not fit `device` with
    HEADROOM_BYTES to spare) and host memory cannot hold them: such a shape is for planning only."""
    from ..engine.host import available_host_bytes

    available = available_host_bytes()
    if available is None or shape.name not in PLANNING_SHAPES:
        return
    weights = shape_weight_bytes(shape.name)
    if weights <= available or build_device(weights, device)[0].type == "cuda":
        return
    raise ValueError(
        f"--shape {shape.name}: its {format_size(weights)} of random weights would be built in host memory, "
        f"which has {format_size(available)} available: plan it instead (weightstream plan {shape.name} "
        "--gpu-memory ...), or run a smaller shape")


def check_phase(shape: Shape, phase: Phase) -> None:
    """Raise ValueError when `shape`'s model kind cannot run `phase` (a generation of a model kind
    without `generate`)."""
    if phase.kind == "generate" and not hasattr(shape.model, "generate"):
        raise ValueError(f"phase {phase.name}: --shape {shape.name} ({shape.model.name}) has no generation; "
                         "generate-N runs on causal and encoder-decoder LM shapes")


def get_shape(name: str) -> Shape:
    """The shape of that name; ValueError listing the known ones."""
    if name not in SHAPES:
        raise ValueError(f"shape {name!r}: choose one of {', '.join(SHAPES)}")
    return SHAPES[name]


def build_model(shape: str, device: torch.device, seed: int = 0) -> nn.Module:
    """A model of `shape` with random weights created on `device`, in eval mode, no grads (its routers
    skewed where the shape carries a routing skew)."""
    s = get_shape(shape)
    model = s.model.build(s.fields, device, seed)
    if s.routing_skew is not None:
        skew_routing(model, s.routing_skew, s.routing_seed)
    return model


def check_routing_skew(shape: str, skew: float | None) -> None:
    """Raise ValueError unless `skew` is None or a Zipf exponent of 0 (uniform) or more for a
    mixture-of-experts shape."""
    if skew is None:
        return
    try:
        check_skew_number(skew)
    except ArgumentError:
        raise ValueError(f"--routing-skew {skew:g}: give a Zipf exponent of 0 (uniform routing) or more "
                         "(e.g. 1.0), or leave it out") from None
    if not get_shape(shape).moe:
        moe = ", ".join(n for n, s in SHAPES.items() if s.moe)
        raise ValueError(f"--routing-skew applies to mixtures of experts, not --shape {shape}: use one of "
                         f"{moe}")


@contextlib.contextmanager
def routing_skew(shape: str, skew: float | None, seed: int = 0):
    """Within the block, shape `shape` is built with a synthetic routing skew of Zipf exponent `skew`
    (seeded by `seed`; None: as it is) and records it; the registry is as before afterwards."""
    if skew is None:
        yield
        return
    check_routing_skew(shape, skew)
    before = SHAPES[shape]
    SHAPES[shape] = dataclasses.replace(before, routing_skew=skew, routing_seed=seed)
    try:
        yield
    finally:
        SHAPES[shape] = before


def shape_weight_bytes(shape: str) -> int:
    """Bytes of the shape's parameters and buffers, from a meta-device build (no memory)."""
    s = get_shape(shape)
    return module_bytes(s.model.meta(s.fields))


def build_device(weight_bytes: int, device: torch.device) -> tuple[torch.device, str]:
    """Where to build the model: `device` when its weights fit there with HEADROOM_BYTES to spare, else
    the CPU; and a sentence saying why."""
    if device.type != "cuda":
        return device, "built on the CPU device"
    free, _ = torch.cuda.mem_get_info(device)
    if weight_bytes + HEADROOM_BYTES <= free:
        return device, f"fits: {format_size(weight_bytes)} of weights, {format_size(free)} free"
    return torch.device("cpu"), (f"does not fit {device}: {format_size(weight_bytes)} of weights + "
                                 f"{format_size(HEADROOM_BYTES)} headroom > {format_size(free)} free")
