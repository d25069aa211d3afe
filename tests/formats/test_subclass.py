"""Quantized weights through the real engine (CPU backend): tensor subclasses (torchao), storage-backed
subclasses (GGUF-style), plain fp8/int8/int4 tensors with scales, and the types that are refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import in_order_copies, make_model, with_boundaries
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import weightstream as ws
from weightstream.formats import fp8, subclass
from weightstream.placement.entries import _collect
from weightstream.placement.layout import ALIGN


def stored_bytes(model) -> int:
    """Bytes weightstream stores for the model: quantized tensors at their quantized size."""
    return sum(e.nbytes for e in _collect(model, []))


def ids_for(seed=0, batch=2, length=9):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def state_leaves(model) -> dict[str, tuple[type, list[torch.Tensor]]]:
    """Every state-dict entry as (type, its plain inner tensors, cloned)."""
    return {k: (type(v), [t.detach().clone() for t in subclass.leaves_of(v)])
            for k, v in model.state_dict().items()}


def assert_same_state(model, original) -> None:
    now = state_leaves(model)
    assert now.keys() == original.keys()
    for key, (cls, leaves) in original.items():
        assert now[key][0] is cls, key
        assert len(now[key][1]) == len(leaves) and all(
            a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b)
            for a, b in zip(now[key][1], leaves, strict=True)), key


def slot_owned(handle, tensor) -> bool:
    """True when every inner tensor of `tensor` is a view into one of the handle's slots."""
    slots = {s.untyped_storage().data_ptr() for s in handle.engine.slots}
    return all(leaf.untyped_storage().data_ptr() in slots for leaf in subclass.leaves_of(tensor))


def offload_streaming(model, strategy="stream"):
    """Offload under the smallest of 60..90% of the stored bytes that holds what must stay resident."""
    for fraction in (0.6, 0.7, 0.8, 0.9):
        budget = int(stored_bytes(model) * fraction)
        try:
            return ws.offload(model, gpu_memory=budget, device="cpu", strategy=strategy), budget
        except ws.BudgetError:
            continue
    raise AssertionError("no budget below 90% streams this model")


def slot_offset(handle, tensor) -> int:
    """Byte offset of `tensor` in the slot that holds it."""
    for slot in handle.engine.slots:
        if slot.data_ptr() <= tensor.data_ptr() < slot.data_ptr() + slot.numel():
            return tensor.data_ptr() - slot.data_ptr()
    raise AssertionError("not in a slot")


def assert_streams_exactly(ref, model, compiled=True):
    """Offload `model` (a copy of the quantized `ref`) under a budget that forces streaming: eager (and
    compiled) logits equal the resident ref's; restore gives the quantized state back bit for bit."""
    original = state_leaves(model)
    handle, budget = offload_streaming(model)
    stats = handle.stats
    assert stats.groups >= 1 and stats.streamed_bytes > 0
    assert stats.resident_bytes + stats.streamed_bytes == stored_bytes(ref)
    assert handle.placement.gpu_bytes <= budget
    streamed = [e for g in handle.engine.groups for e, _ in g]
    assert all(slot_owned(handle, e.tensor) for e in streamed)
    leaves = [leaf for e in streamed for leaf in subclass.leaves_of(e.tensor)]
    assert all(slot_offset(handle, leaf) % ALIGN == 0 for leaf in leaves)
    with torch.no_grad():
        for seed in range(2):
            assert torch.equal(model(ids_for(seed)).logits, ref(ids_for(seed)).logits)
    assert handle.stats.copies == in_order_copies(stats, 2)  # the schedule ran, in order
    if compiled:
        torch._dynamo.reset()
        # the reference carries the (idle) ops at the streamed blocks' edges: Inductor fuses the
        # quantized resident graph across them (docs/exactness.md)
        edges = with_boundaries(copy.deepcopy(ref), handle.streamed_blocks)
        cref, cmodel = torch.compile(edges, fullgraph=True), torch.compile(model, fullgraph=True)
        with torch.no_grad():
            assert torch.equal(cmodel(ids_for(3)).logits, cref(ids_for(3)).logits)
            assert handle.stats.copies == in_order_copies(stats, 3)  # the schedule ran in the graph
        torch._dynamo.reset()
    handle.restore()
    assert_same_state(model, original)
    with torch.no_grad():
        assert torch.equal(model(ids_for()).logits, ref(ids_for()).logits)
    return stats


# --- layout of a flattened subclass --------------------------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.int32]


class Quantized(torch.Tensor):
    """A minimal traceable wrapper subclass: quantized data and a scale of any dtypes and shapes (the
    scale may itself be one), as torchao's tensors hold them."""

    @staticmethod
    def __new__(cls, qdata, scale):
        t = torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=torch.float32)
        t.qdata, t.scale = qdata, scale
        return t

    def __tensor_flatten__(self):
        return ["qdata", "scale"], {"note": "ctx"}

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        assert ctx == {"note": "ctx"}
        return Quantized(inner["qdata"], inner["scale"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


def random_leaf(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    t = torch.randint(0, 100, shape, dtype=torch.int32).to(torch.float32).to(dtype)
    if len(shape) >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)  # a transposed inner tensor keeps its strides
    return t


@st.composite
def quantized(draw, depth=0):
    qdata = random_leaf(draw)
    scale = draw(quantized(depth + 1)) if depth < 2 and draw(st.booleans()) else random_leaf(draw)
    return Quantized(qdata, scale)


@settings(max_examples=40, deadline=None)
@given(quantized())
def test_a_flattened_subclass_round_trips_through_its_bytes(tensor):
    flat = subclass.flatten(tensor, "w")
    leaves = subclass.leaves_of(tensor)
    assert len(flat.leaves) == len(leaves)
    ends = 0
    for leaf, t in zip(flat.leaves, leaves, strict=True):
        assert leaf.offset % ALIGN == 0 and leaf.offset >= ends  # aligned, in order, disjoint
        ends = leaf.offset + leaf.nbytes
        assert leaf.nbytes == t.numel() * t.element_size()
    assert flat.nbytes == ends
    raw = torch.zeros(flat.nbytes + 7, dtype=torch.uint8)
    rebuilt = flat.view_of(raw)
    subclass.copy_leaves(rebuilt, tensor)
    assert type(rebuilt) is type(tensor) and rebuilt.shape == tensor.shape
    for got, want in zip(subclass.leaves_of(rebuilt), leaves, strict=True):
        assert got.stride() == want.stride() and got.dtype == want.dtype and torch.equal(got, want)
        assert got.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()  # a view of the bytes
    again = flat.copy_of(raw, torch.device("cpu"))
    assert all(torch.equal(x, y) for x, y in zip(subclass.leaves_of(again), leaves, strict=True))


def test_an_overlapping_inner_tensor_is_stored_contiguous():
    a = torch.arange(4.0).expand(3, 4)  # stride (0, 1): three rows share one
    flat = subclass.flatten(Quantized(a, torch.ones(3)), "w")
    assert flat.leaves[0].stride == (4, 1) and flat.leaves[0].nbytes == 12 * 4


# --- torchao ---------------------------------------------------------------------------------------------


def torchao_configs():
    ao = pytest.importorskip("torchao.quantization")
    return {
        "int8": ao.Int8WeightOnlyConfig(),
        "float8": ao.Float8WeightOnlyConfig(),
        "int4": ao.IntxWeightOnlyConfig(weight_dtype=torch.int4),  # torchao's int4 that runs on a CPU
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["int8", "float8", "int4"])
def test_torchao_weight_only_models_stream_exactly(name):
    from torchao.quantization import quantize_

    ref = make_model("llama")
    quantize_(ref, torchao_configs()[name])
    weight = ref.model.layers[0].mlp.up_proj.weight
    assert subclass.leaves_of(weight) != [weight]  # really a subclass
    model = copy.deepcopy(ref)
    stats = assert_streams_exactly(ref, model)
    dense = sum(p.numel() * 4 for p in make_model("llama").parameters())
    assert stats.resident_bytes + stats.streamed_bytes < dense / 2  # quantized bytes, not float32's
    assert type(model.model.layers[0].mlp.up_proj.weight) is type(weight)


def test_torchao_bf16_model_streams_exactly_eager():
    from torchao.quantization import quantize_

    ref = make_model("llama", dtype=torch.bfloat16)
    quantize_(ref, torchao_configs()["int8"])
    assert_streams_exactly(ref, copy.deepcopy(ref), compiled=False)


def test_torchao_model_streams_exactly_zero_copy_and_auto():
    from torchao.quantization import quantize_

    ref = make_model("llama")
    quantize_(ref, torchao_configs()["float8"])
    for strategy in ("uva", "auto"):
        model = copy.deepcopy(ref)
        handle, _ = offload_streaming(model, strategy)
        assert handle.stats.streamed_bytes + handle.stats.uva_bytes > 0
        with torch.no_grad():
            assert torch.equal(model(ids_for()).logits, ref(ids_for()).logits)
        handle.restore()


# --- storage-backed subclasses (as diffusers' GGUFParameter) ---------------------------------------------


class PackedParameter(nn.Parameter):
    """Built like diffusers' GGUFParameter: its own uint8 storage, plain attributes, and a
    __torch_function__ that keeps the class and quant_type through torch functions."""

    def __new__(cls, data, requires_grad=False, quant_type=None):
        self = torch.Tensor._make_subclass(cls, data, requires_grad)
        self.quant_type = quant_type
        self.quant_shape = (*data.shape[:-1], data.shape[-1] * 2) if data.dim() else ()
        return self

    def as_tensor(self):
        return torch.Tensor._make_subclass(torch.Tensor, self, self.requires_grad)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        result = super().__torch_function__(func, types, args, kwargs or {})
        quant_type = next((a.quant_type for a in args if isinstance(a, PackedParameter)), None)
        return cls(result, quant_type=quant_type) if isinstance(result, torch.Tensor) else result


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(n, k/2) uint8, two 4-bit values a byte (low nibble first), to (n, k) int8 in -8..7."""
    low, high = (packed & 0xF).to(torch.int8), (packed >> 4).to(torch.int8)
    return torch.stack((low, high), dim=-1).flatten(-2) - 8


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    u = (q + 8).to(torch.uint8)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()


class Int4Linear(nn.Module):
    """Packed int4 weight (uint8, two a byte) with a per-row scale; `packed_class` wraps the weight."""

    def __init__(self, linear: nn.Linear, packed_class=None):
        super().__init__()
        w = linear.weight.detach()
        scale = w.abs().amax(dim=1, keepdim=True) / 7
        packed = pack_int4(torch.round(w / scale).clamp(-8, 7).to(torch.int8))
        self.weight = (packed_class(packed, quant_type=2) if packed_class
                       else nn.Parameter(packed, requires_grad=False))
        self.scale = nn.Parameter(scale.to(w.dtype), requires_grad=False)

    def forward(self, x):
        weight = self.weight if type(self.weight) is nn.Parameter else self.weight.as_tensor()
        return F.linear(x, unpack_int4(weight).to(x.dtype) * self.scale)


class Int8Linear(nn.Module):
    """int8 weight with a per-row float scale (weight-only), as plain parameters."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        self.weight = nn.Parameter(torch.round(w / scale).to(torch.int8), requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype) * self.scale)


def swap_linears(model, make):
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and "layers" in name:
            model.set_submodule(name, make(module))
    return model


def test_a_storage_backed_parameter_subclass_streams_and_keeps_its_class():
    ref = swap_linears(make_model("llama"), lambda m: Int4Linear(m, PackedParameter))
    # built again rather than deep-copied: Parameter.__deepcopy__ drops a subclass's attributes
    model = swap_linears(make_model("llama"), lambda m: Int4Linear(m, PackedParameter))
    weight = model.model.layers[1].mlp.down_proj.weight
    assert type(weight) is PackedParameter
    assert_streams_exactly(ref, model, compiled=False)
    assert model.model.layers[1].mlp.down_proj.weight is weight  # identity and attributes kept
    assert weight.quant_type == 2 and type(weight) is PackedParameter


# --- plain low-precision tensors with scales ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_plain_fp8_weights_with_block_scales_stream_exactly(dtype):
    ref = fp8.quantize_model(make_model("llama"), block_size=(32, 32), dtype=dtype)
    assert ref.model.layers[0].self_attn.q_proj.weight.dtype == dtype
    assert_streams_exactly(ref, copy.deepcopy(ref), compiled=False)  # compiled: test_fp8.py


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_plain_int8_and_packed_int4_weights_stream_exactly(kind):
    make = Int8Linear if kind == "int8" else Int4Linear
    ref = swap_linears(make_model("llama"), make)
    assert_streams_exactly(ref, copy.deepcopy(ref), compiled=kind == "int4")


# --- refused types ------------------------------------------------------------------------------------------


class OpaqueTensor(torch.Tensor):
    """A wrapper subclass with its own __torch_dispatch__ but no __tensor_flatten__."""

    @staticmethod
    def __new__(cls, inner):
        t = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)
        t.inner = inner
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, OpaqueTensor) else t  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


class StatefulParameter(nn.Parameter):
    """A storage-backed subclass that keeps a tensor outside its storage (as bitsandbytes does)."""

    def __new__(cls, data, absmax):
        self = torch.Tensor._make_subclass(cls, data, False)
        self.absmax = absmax
        return self


def assert_refused(model, match):
    before = state_leaves(model)
    with pytest.raises(ws.UnsupportedTensorError, match=match):
        ws.offload(model, gpu_memory=int(stored_bytes(model) * 0.6), device="cpu", strategy="stream")
    assert_same_state(model, before)  # nothing moved
    model.to(torch.float32)  # not left offloaded


def test_a_subclass_without_flatten_is_refused_by_name():
    model = make_model("llama")
    w = model.model.layers[2].mlp.up_proj.weight
    model.model.layers[2].mlp.up_proj._parameters["weight"] = OpaqueTensor(w.detach().clone())
    name = r"model\.layers\.2\.mlp\.up_proj\.weight.*OpaqueTensor"
    with pytest.raises(ws.UnsupportedTensorError, match=name):
        ws.offload(model, gpu_memory=10**6, device="cpu")


def test_a_subclass_with_tensors_outside_its_storage_is_refused_by_name():
    model = make_model("llama")
    w = model.model.layers[1].self_attn.o_proj.weight
    model.model.layers[1].self_attn.o_proj.weight = StatefulParameter(w.detach().clone(), torch.ones(3))
    assert_refused(model, r"model\.layers\.1\.self_attn\.o_proj\.weight.*StatefulParameter.*'absmax'")


@pytest.mark.parametrize("bits", [4, 8])
def test_bitsandbytes_parameters_are_refused_naming_what_works(bits):
    bnb = pytest.importorskip("bitsandbytes")
    model = make_model("llama")
    old = model.model.layers[0].mlp.gate_proj
    if bits == 4:
        new = bnb.nn.Linear4bit(old.in_features, old.out_features, bias=False, compute_dtype=torch.float32)
        new.weight = bnb.nn.Params4bit(old.weight.detach().clone(), requires_grad=False)
        new = new.to("cpu")
    else:
        new = bnb.nn.Linear8bitLt(old.in_features, old.out_features, bias=False, has_fp16_weights=False)
        new.weight = bnb.nn.Int8Params(old.weight.detach().clone(), requires_grad=False,
                                       has_fp16_weights=False)
    model.model.layers[0].mlp.set_submodule("gate_proj", new.requires_grad_(False))
    name = "Params4bit" if bits == 4 else "Int8Params"
    assert_refused(model, rf"model\.layers\.0\.mlp\.gate_proj\.weight: {name} \(bitsandbytes\).*torchao")
