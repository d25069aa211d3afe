"""What kind of weight a tensor is for the engine, decided before anything moves.

- plain (`torch.Tensor`, `nn.Parameter`), any dtype: fp8, int8 and packed int4 bytes with their scales
  stream like bf16 ones;
- a traceable wrapper subclass (torchao's tensors): streamed as its inner tensors (`subclass.py`);
- a storage-backed subclass (`_make_subclass`, as diffusers' GGUFParameter) whose attributes are plain
  values: its own bytes are all of it, so it streams like a plain tensor and keeps class and attributes;
- anything else is refused with an `UnsupportedTensorError` naming the tensor, its type and what works
  instead: bitsandbytes' parameters (quantization state in tensors outside the module tree, weight.data
  rebound by their forward: docs/quantized.md), subclasses with their own `__torch_dispatch__` but no
  `__tensor_flatten__`, and storage-backed ones holding tensors or other objects in attributes.
It also says what a bf16 GEMM over a quantized weight would read, for the cost model.
"""

from __future__ import annotations

import enum

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..errors import UnsupportedTensorError
from ..formats.subclass import Flattened, flatten, type_name

_PLAIN = (torch.Tensor, nn.Parameter)
_SIMPLE = (type(None), bool, int, float, str, enum.Enum, torch.dtype, torch.Size, torch.device)


def _bnb_hint(t: torch.Tensor) -> str | None:
    if not type(t).__module__.startswith("bitsandbytes"):
        return None
    return (
        f"{type(t).__name__} (bitsandbytes) cannot be streamed: its quantization state (absmax, code, "
        "the 8-bit CB/SCB) lives in tensors outside the model's parameters, and its forward rebinds "
        "weight.data, so a streamed view would be replaced and the GPU copy never freed (docs/quantized.md). "
        "Quantize with torchao instead (Int8WeightOnlyConfig, Int4WeightOnlyConfig, "
        "Float8WeightOnlyConfig), or load an FP8 checkpoint, which weightstream streams as stored"
    )


def check(tensor: torch.Tensor, name: str) -> Flattened | None:
    """How weightstream stores `tensor` (named `name` in messages): None for a plain tensor or a
    storage-backed subclass (its own bytes), a Flattened layout for a wrapper subclass. Raises
    UnsupportedTensorError naming the tensor and its type for anything it cannot stream exactly."""
    if type(tensor) in _PLAIN:
        return None
    hint = _bnb_hint(tensor)
    if hint is not None:
        raise UnsupportedTensorError(f"{name}: {hint}")
    if is_traceable_wrapper_subclass(tensor):
        if tensor.is_meta:
            raise UnsupportedTensorError(
                f"{name} is a {type_name(tensor)} on the meta device: load its inner tensors first")
        return flatten(tensor, name)
    if hasattr(type(tensor), "__torch_dispatch__") and type(tensor).__torch_dispatch__ is not \
            torch.Tensor.__torch_dispatch__:
        raise UnsupportedTensorError(
            f"{name} is a {type_name(tensor)}, a tensor subclass with its own __torch_dispatch__ but no "
            "__tensor_flatten__/__tensor_unflatten__: weightstream cannot tell which tensors hold its "
            "bytes. Implement those two methods (as torchao's tensors do) or keep it off the streamed blocks"
        )
    for attr, value in vars(tensor).items():
        if attr != "_is_param" and not _simple(value):
            raise UnsupportedTensorError(
                f"{name} is a {type_name(tensor)} whose attribute {attr!r} holds a {type(value).__name__}: "
                "weightstream streams a storage-backed subclass only when its bytes are all in its own "
                "storage (attributes of plain values, as diffusers' GGUFParameter), so it cannot stream "
                "this one exactly; keep it off the streamed blocks or use a torchao quantization config"
            )
    return None


def _simple(value: object) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_simple(v) for v in value)
    return isinstance(value, _SIMPLE)


def with_class_of(template: torch.Tensor, plain: torch.Tensor) -> torch.Tensor:
    """`plain` (a view of some bytes) as a tensor of `template`'s storage-backed subclass, with its
    attributes (a GGUF buffer stays a GGUF tensor); `plain` itself for a plain template."""
    if type(template) in _PLAIN:
        return plain
    rebuilt = torch.Tensor._make_subclass(type(template), plain, False)
    rebuilt.__dict__.update(vars(template))
    return rebuilt


# 1-byte weights hold one weight a byte, except uint8, which holds two (packed int4)
_WEIGHTS_PER_BYTE = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 1, torch.int8: 1, torch.uint8: 2}


def bf16_bytes(tensor: torch.Tensor, nbytes: int) -> int:
    """Bytes a bf16 GEMM over the same weights as `tensor` (stored in `nbytes`) would read: the cost
    model times a quantized weight's dequantizing GEMM from it. `nbytes` itself for a plain tensor
    of 2 bytes or more, or one that is not a matrix (a scale, a bias)."""
    if is_traceable_wrapper_subclass(tensor):
        return 2 * tensor.numel()
    if tensor.dim() < 2 or tensor.dtype not in _WEIGHTS_PER_BYTE:
        return nbytes
    return 2 * _WEIGHTS_PER_BYTE[tensor.dtype] * tensor.numel()
