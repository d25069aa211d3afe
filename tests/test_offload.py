"""The engine end to end on the CPU (synchronous backend): real schedule, real ops, real compile."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import ARCHS, in_order_copies, state_copy, weight_bytes
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import weightstream as ws
from weightstream.engine.guards import live_parameters
from weightstream.placement.cost import largest


def ids_for(seed: int = 0, batch: int = 2, length: int = 9) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (batch, length), generator=gen)


def budget_for(model, fraction: float) -> int:
    return int(weight_bytes(model) * fraction)


@pytest.mark.parametrize("strategy", ["stream", "uva", "auto"])
@pytest.mark.parametrize("fraction", [0.45, 0.75])
@pytest.mark.parametrize("arch", ARCHS)
def test_eager_logits_are_bit_identical(twin, arch, fraction, strategy):
    ref, model = twin(arch)
    handle = ws.offload(model, gpu_memory=budget_for(model, fraction), device="cpu", strategy=strategy)
    with torch.no_grad():
        for seed in range(2):
            ids = ids_for(seed)
            assert torch.equal(model(ids).logits, ref(ids).logits)
    stats = handle.stats
    assert stats.requested_strategy == strategy and (stats.placement_kind == strategy or strategy == "auto")
    assert stats.streamed_bytes + stats.uva_bytes > 0
    assert stats.misses == 0 and stats.copies == in_order_copies(stats, 2)  # the planned schedule ran
    assert stats.resident_bytes + stats.streamed_bytes + stats.uva_bytes == weight_bytes(ref)
    assert handle.placement.gpu_bytes <= budget_for(ref, fraction)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["stream", "uva"])
@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_fullgraph_is_bit_identical_to_compiled_resident(twin, arch, strategy):
    ref, model = twin(arch)
    handle = ws.offload(model, gpu_memory=budget_for(model, 0.5), device="cpu", strategy=strategy)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cref = torch.compile(ref, fullgraph=True)
    cmodel = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        for seed in range(2):
            ids = ids_for(seed)
            assert torch.equal(cmodel(ids).logits, cref(ids).logits)
            # the ops run inside the graph
            assert handle.stats.copies == in_order_copies(handle.stats, seed + 1)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert handle.stats.misses == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generate_gives_the_same_tokens(twin, arch):
    ref, model = twin(arch)
    ws.offload(model, gpu_memory=budget_for(model, 0.5), device="cpu", strategy="stream")
    ids = ids_for(1, batch=1)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))


@pytest.mark.parametrize("arch", ARCHS)
def test_restore_gives_back_the_original_state_bit_for_bit(twin, arch):
    ref, model = twin(arch)
    original = state_copy(model)
    classes = [type(m) for m in model.modules()]
    handle = ws.offload(model, gpu_memory=budget_for(model, 0.4), device="cpu", strategy="stream")
    with torch.no_grad():
        model(ids_for())
    assert handle.restore() is model
    restored = model.state_dict()
    assert restored.keys() == original.keys()
    assert all(torch.equal(restored[k], original[k]) for k in original)
    assert [type(m) for m in model.modules()] == classes
    assert not hasattr(model, "_weightstream_handle")
    model.to(torch.float64)  # an ordinary module again
    with pytest.raises(ws.OffloadStateError, match="already restored"):
        handle.restore()


def test_tied_embedding_is_stored_once(twin):
    ref, model = twin("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    handle = ws.offload(model, gpu_memory=budget_for(model, 0.5), device="cpu", strategy="stream")
    assert model.lm_head.weight is model.transformer.wte.weight
    assert handle.stats.resident_bytes + handle.stats.streamed_bytes == weight_bytes(ref)


def test_streamed_parameters_are_fixed_views_into_the_slots(twin):
    _, model = twin("llama")
    handle = ws.offload(model, gpu_memory=budget_for(model, 0.4), device="cpu", strategy="stream")
    slots = {s.data_ptr(): s for s in handle.engine.slots}
    layer = dict(model.named_modules())[handle.streamed_blocks[0]]
    in_slots = [p for p in live_parameters(layer) if p.untyped_storage().data_ptr() in slots]
    # the whole block, or its `part` largest tensors when the planner streams part of each block
    assert len(in_slots) == (handle.placement.part or len(live_parameters(layer)))
    ptrs = [p.data_ptr() for p in live_parameters(layer)]
    with torch.no_grad():
        model(ids_for())
    assert ptrs == [p.data_ptr() for p in live_parameters(layer)]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_placement_streaming_part_of_each_block_is_exact(twin, arch):
    """Search the budgets for placements that stream each block's largest tensors only: outputs are
    bit-identical, exactly those tensors stream, and the rest of each block stays resident."""
    ref, model = twin(arch)
    seen = 0
    for fraction in (0.45, 0.6, 0.75, 0.9):
        handle = ws.offload(model, gpu_memory=budget_for(model, fraction), device="cpu", strategy="stream")
        p = handle.placement
        if p.part:
            seen += 1
            blocks = dict(model.named_modules())
            slots = {s.untyped_storage().data_ptr() for s in handle.engine.slots}
            for name in handle.streamed_blocks:
                sizes = [t.nbytes for t in live_parameters(blocks[name])]
                in_slot = [t.untyped_storage().data_ptr() in slots for t in live_parameters(blocks[name])]
                assert in_slot == [i in largest(tuple(sizes), p.part) for i in range(len(sizes))]
            with torch.no_grad():
                assert torch.equal(model(ids_for()).logits, ref(ids_for()).logits)
            assert handle.stats.misses == 0 and handle.stats.copies == in_order_copies(handle.stats, 1)
        handle.restore()
    assert seen, "no budget gave a parameter-granular placement"


def test_everything_resident_when_the_budget_allows(twin):
    ref, model = twin("llama")
    handle = ws.offload(model, gpu_memory=weight_bytes(model), device="cpu", strategy="stream")
    assert handle.stats.groups == 0 and handle.stats.staging_bytes == 0
    with torch.no_grad():
        assert torch.equal(model(ids_for()).logits, ref(ids_for()).logits)


# --- the unexpected order: a toy model whose forward can repeat, skip or reorder blocks -------------

class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.register_buffer("scale", torch.rand(dim))
        self.register_buffer("cache", torch.zeros(dim), persistent=False)

    def forward(self, x):
        return torch.tanh(self.fc(x)) * self.scale + x


class Toy(nn.Module):
    def __init__(self, n: int = 6, dim: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(n))
        self.order = list(range(n))

    def forward(self, x):
        x = self.inp(x)
        for i in self.order:
            x = self.layers[i](x)
        return x


def toy_twin(seed: int = 0):
    torch.manual_seed(seed)
    ref = Toy().eval().requires_grad_(False)
    return ref, copy.deepcopy(ref)


def toy_streaming_all(model):
    """Offload the toy with the smallest budget streaming allows (the fixed part and one slot), so
    every block streams, through one slot."""
    with pytest.raises(ws.BudgetError) as info:
        ws.offload(model, gpu_memory=0, device="cpu", strategy="stream")
    return ws.offload(model, gpu_memory=info.value.minimum_bytes, device="cpu", strategy="stream")


@pytest.mark.parametrize(
    "order", [[0, 1, 2, 2, 3, 4, 5], [0, 1, 3, 4, 5], [5, 4, 3, 2, 1, 0], [2, 3], [0, 0, 0], []]
)
def test_unexpected_orders_still_use_the_right_weights(order):
    ref, model = toy_twin()
    handle = toy_streaming_all(model)
    assert handle.stats.groups == 6
    x = torch.randn(3, 16)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for o in (order, list(range(6)), order):
            ref.order = model.order = o
            assert torch.equal(model(x), ref(x))
    misses = [w for w in caught if "out of the learned order" in str(w.message)]
    # warned once per model, and only where a learned order changed (not on the first pass's guesses)
    assert len(misses) == (1 if handle.engine.schedule.changes else 0)


def test_a_first_pass_out_of_module_order_does_not_warn_but_a_changed_order_does():
    """A model that runs its blocks out of module order (a UNet's mid block, a VAE run decoder-only)
    misses on its first pass, where nothing was learned yet: counted, not warned. Once that order was
    seen, running another one is a change and warns (once)."""
    ref, model = toy_twin()
    handle = toy_streaming_all(model)
    x = torch.randn(3, 16)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref.order = model.order = [0, 2, 1, 3, 5, 4]
        for _ in range(3):
            assert torch.equal(model(x), ref(x))
        first = handle.stats.misses
        assert first >= 1 and handle.engine.schedule.changes == 0
        assert not [w for w in caught if "out of the learned order" in str(w.message)]
        ref.order = model.order = [0, 1, 2, 3, 4, 5]
        for _ in range(2):
            assert torch.equal(model(x), ref(x))
    assert handle.engine.schedule.changes >= 1
    assert len([w for w in caught if "out of the learned order" in str(w.message)]) == 1


def test_one_block_called_by_hand_between_forwards():
    ref, model = toy_twin()
    toy_streaming_all(model)
    x = torch.randn(3, 16)
    with torch.no_grad(), pytest.warns(UserWarning, match="out of the learned order"):
        assert torch.equal(model(x), ref(x))
        assert torch.equal(model.layers[3](x), ref.layers[3](x))
        assert torch.equal(model(x), ref(x))


def test_persistent_buffers_stream_and_non_persistent_stay_resident():
    _, model = toy_twin()
    handle = toy_streaming_all(model)
    slots = {s.untyped_storage().data_ptr() for s in handle.engine.slots}
    block = model.layers[1]
    assert block.scale.untyped_storage().data_ptr() in slots
    assert block.cache.untyped_storage().data_ptr() not in slots


def test_a_parameter_shared_by_all_blocks_stays_resident():
    torch.manual_seed(0)
    ref = Toy().eval().requires_grad_(False)
    for layer in ref.layers[1:]:
        layer.fc.bias = ref.layers[0].fc.bias  # shared across blocks, ALBERT style
    model = copy.deepcopy(ref)
    handle = toy_streaming_all(model)
    slots = {s.untyped_storage().data_ptr() for s in handle.engine.slots}
    assert model.layers[2].fc.bias.untyped_storage().data_ptr() not in slots
    assert model.layers[2].fc.bias is model.layers[0].fc.bias
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))



@settings(max_examples=20, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)).filter(lambda p: p[0] != p[1]),
                      min_size=1, max_size=3),
       strategy=st.sampled_from(["stream", "uva"]))
def test_a_submodule_held_by_two_blocks_stays_resident_and_both_read_it(pairs, strategy):
    """One module object registered in two blocks (weight sharing by module): `named_modules()` lists it
    once, under one block; streamed with that block, the other block read whatever the slot held."""
    torch.manual_seed(0)
    ref = Toy().eval().requires_grad_(False)
    for i, j in pairs:
        ref.layers[j].fc = ref.layers[i].fc
    model = copy.deepcopy(ref)
    with pytest.raises(ws.BudgetError) as info:
        ws.offload(model, gpu_memory=0, device="cpu", strategy=strategy)
    handle = ws.offload(model, gpu_memory=info.value.minimum_bytes, device="cpu", strategy=strategy)
    holders = {id(layer.fc): sum(other.fc is layer.fc for other in model.layers) for layer in model.layers}
    for entry in handle.engine.entries:
        if isinstance(entry.sites[0].module, nn.Linear) and entry.sites[0].module is not model.inp:
            assert (entry.owner is None) == (holders[id(entry.sites[0].module)] > 1)
    x = torch.randn(3, 16)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), ref(x))
    handle.restore()
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


@settings(max_examples=16, deadline=None)
@given(built_inside=st.booleans(), offloaded_inside=st.booleans(),
       strategy=st.sampled_from(["stream", "uva"]))
def test_inference_mode_while_building_or_offloading_keeps_outputs_and_write_checks(
        built_inside, offloaded_inside, strategy):
    """A model built under torch.inference_mode (its parameters inference tensors) or offloaded under it
    (the staging tensors would be inference tensors): neither keeps a version counter, so the engine
    could not see a write between forwards (it went unnoticed, silently wrong) and offloading raised
    half way. Outputs stay exact, a write to a streamed weight between forwards is refused, restore
    gives the model back."""
    from weightstream.errors import OffloadStateError

    with torch.inference_mode(built_inside):
        torch.manual_seed(0)
        ref, model = Toy().eval(), Toy().eval()
        model.load_state_dict(ref.state_dict())
    with torch.inference_mode(offloaded_inside):
        with pytest.raises(ws.BudgetError) as info:
            ws.offload(model, gpu_memory=0, device="cpu", strategy=strategy)
        handle = ws.offload(model, gpu_memory=info.value.minimum_bytes, device="cpu", strategy=strategy)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        assert torch.equal(model(x), ref(x))
        model.layers[2].fc.weight.mul_(2)
        ref.layers[2].fc.weight.mul_(2)
        if strategy == "stream":  # the write landed in a staging slot: refused
            with pytest.raises(OffloadStateError, match="written in place outside"):
                model(x)
        else:  # zero copy: the write landed in the weight's own host memory
            assert torch.equal(model(x), ref(x))
    if strategy == "stream":
        return
    handle.restore()
    with torch.inference_mode():
        assert torch.equal(model(x), ref(x))


class Laid(nn.Module):
    """A block whose weights are laid out in another order than rows (a transposed weight, a
    channels_last convolution, a permuted 3-D tensor); records the strides its forward sees."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        self.layout, self.seen = layout, []
        if layout == "transposed":
            self.w = nn.Parameter(torch.randn(16, 16).t() / 4)
        elif layout == "channels_last":
            self.w = nn.Parameter(torch.randn(4, 4, 3, 3).contiguous(memory_format=torch.channels_last) / 4)
        else:  # permuted
            self.w = nn.Parameter(torch.randn(4, 16, 4).permute(2, 0, 1) / 4)
        self.b = nn.Parameter(torch.randn(16))

    def forward(self, x):
        self.seen.append(self.w.stride())
        if self.layout == "channels_last":
            y = nn.functional.conv2d(x.view(-1, 4, 2, 2), self.w, padding=1).reshape(x.shape)
        else:
            y = x @ self.w.reshape(16, 16)
        return torch.tanh(y + self.b) + x


@settings(max_examples=12, deadline=None)
@given(layouts=st.lists(st.sampled_from(["transposed", "channels_last", "permuted"]), min_size=4, max_size=4),
       strategy=st.sampled_from(["stream", "uva"]))
def test_weights_laid_out_in_another_order_keep_their_strides_offloaded_and_restored(layouts, strategy):
    """Kernels choose their paths, and so their bits, by layout: a weight placed as rows (it was) gave
    other bits than the resident transposed or channels_last one, also after restore()."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Laid(kind) for kind in layouts)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    ref = Net().eval().requires_grad_(False)
    model = copy.deepcopy(ref)
    try:  # every block off the GPU
        handle = ws.offload(model, gpu_memory=0, device="cpu", strategy=strategy)
    except ws.BudgetError as e:  # streaming needs a slot
        handle = ws.offload(model, gpu_memory=e.minimum_bytes, device="cpu", strategy=strategy)
    assert len(handle.placement.streamed) + len(handle.placement.uva) == 4
    x = torch.randn(3, 16)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), ref(x))
        assert [m.seen for m in model.layers] == [r.seen for r in ref.layers]
        assert [p.stride() for p in model.parameters()] == [p.stride() for p in ref.parameters()]
        handle.restore()
        assert torch.equal(model(x), ref(x))
    assert [p.stride() for p in model.parameters()] == [p.stride() for p in ref.parameters()]


@settings(max_examples=15, deadline=None)
@given(picks=st.sets(st.integers(0, 11), min_size=1, max_size=4), own=st.booleans(), calls=st.integers(1, 3))
def test_functional_call_swaps_weights_for_one_call_and_the_model_streams_as_before(picks, own, calls):
    """torch.func.functional_call binds other tensors for one call and puts the originals back: the
    engine adopts what is bound during the call, then streams the originals again (it kept the
    swapped-in tensors, so state_dict() and restore() gave staging bytes)."""
    from torch.func import functional_call

    ref, model = toy_twin()
    handle = toy_streaming_all(model)
    streamed = [len(group) for group in handle.engine.groups]
    names = [n for n, _ in ref.named_parameters() if n.startswith("layers.")]
    chosen = [names[i % len(names)] for i in sorted(picks)]
    gen = torch.Generator().manual_seed(len(chosen))
    given = dict(model.named_parameters()) if own else {}
    swap = {n: given[n] if own else torch.randn(ref.get_parameter(n).shape, generator=gen) for n in chosen}
    x = torch.randn(3, 16)
    with torch.no_grad():
        for _ in range(calls):
            assert torch.equal(functional_call(model, swap, (x,)), functional_call(ref, swap, (x,)))
            assert torch.equal(model(x), ref(x))
    assert sorted(handle.engine.names) == sorted(f"layers.{i}" for i in range(6))
    assert [len(group) for group in handle.engine.groups] == streamed  # every weight streams again
    assert state_copy(model).keys() == state_copy(ref).keys()
    assert all(torch.equal(a, b) for a, b in zip(state_copy(model).values(), state_copy(ref).values(),
                                                 strict=True))
    handle.restore()
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


class _Wrap(nn.Module):
    """A module wrapping a block's own layer where it was (as PEFT's LoRA layers do)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 0.5


@pytest.mark.parametrize("what", ["tie a resident weight", "share a submodule", "parametrize"])
def test_binding_a_streamed_tensor_outside_its_block_after_offload_is_refused_at_once(what):
    """A streamed tensor is a view of a slot other blocks share: bound elsewhere after offload (weights
    tied, a block's submodule registered in another block, a parametrization taking it as its
    `original`) it was read outside its block's forward, silently wrong."""
    from torch.nn.utils import parametrize

    from weightstream.errors import OffloadStateError

    _, model = toy_twin()
    toy_streaming_all(model)
    with pytest.raises(OffloadStateError, match="streams through a staging buffer that other blocks share"):
        if what == "tie a resident weight":
            model.inp.weight = model.layers[3].fc.weight
        elif what == "share a submodule":
            model.layers[4].fc = model.layers[1].fc
        else:
            parametrize.register_parametrization(model.layers[2].fc, "bias", nn.Identity())


def test_wrapping_a_layer_where_it_is_after_offload_stays_exact():
    ref, model = toy_twin()
    toy_streaming_all(model)
    for m in (ref, model):
        m.layers[2].fc = _Wrap(m.layers[2].fc)
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))

def test_two_offloaded_models_in_one_process_are_independent():
    ref_a, a = toy_twin(0)
    ref_b, b = toy_twin(1)
    ha, hb = toy_streaming_all(a), toy_streaming_all(b)
    x = torch.randn(3, 16)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(a(x), ref_a(x))
            assert torch.equal(b(x), ref_b(x))
        a.order = ref_a.order = [0, 1, 2]  # interleave: a stops half way, then b runs, then a again
        assert torch.equal(a(x), ref_a(x))
        assert torch.equal(b(x), ref_b(x))
        a.order = ref_a.order = list(range(6))
        assert torch.equal(a(x), ref_a(x))
    assert ha.engine.engine_id != hb.engine.engine_id and hb.stats.misses == 0
    ha.restore()
    with torch.no_grad():
        assert torch.equal(b(x), ref_b(x))


def test_a_model_dropped_without_restore_frees_its_engine():
    import gc

    _, model = toy_twin()
    engine_id = toy_streaming_all(model).engine.engine_id
    assert engine_id in ws.engine.ops._ENGINES
    del model
    gc.collect()
    assert engine_id not in ws.engine.ops._ENGINES


# --- bad input --------------------------------------------------------------------------------------

def test_budget_too_small_names_the_minimum():
    _, model = toy_twin()
    with pytest.raises(ws.BudgetError, match=r"at least .* \((\d+) bytes\)") as info:
        ws.offload(model, gpu_memory=1000, device="cpu", strategy="stream")
    minimum = info.value.minimum_bytes
    assert f"({minimum} bytes)" in str(info.value)
    handle = ws.offload(model, gpu_memory=minimum, device="cpu", strategy="stream")  # the minimum works
    assert handle.stats.slots == 1




@pytest.mark.parametrize("move", [lambda m: m.to(torch.float64), lambda m: m.cuda(), lambda m: m.half(),
                                  lambda m: m.layers[0].to("cpu")])
def test_moving_an_offloaded_model_is_refused(move):
    _, model = toy_twin()
    toy_streaming_all(model)
    with pytest.raises(ws.OffloadStateError, match=r"handle.restore\(\)"):
        move(model)


def test_meta_parameters_are_refused():
    with torch.device("meta"):
        model = Toy().eval().requires_grad_(False)
    with pytest.raises(ws.OffloadStateError, match="meta device"):
        ws.offload(model, gpu_memory="1GB", device="cpu")


def test_offloading_twice_is_refused():
    _, model = toy_twin()
    toy_streaming_all(model)
    with pytest.raises(ws.OffloadStateError, match="already offloaded"):
        ws.offload(model, gpu_memory="1GB", device="cpu")
    with pytest.raises(ws.OffloadStateError, match="already offloaded"):
        ws.offload(model.layers[0], gpu_memory="1GB", device="cpu")


@pytest.mark.parametrize("bad", ["lots", "-3GB", None])
def test_bad_budget_strings_are_refused(bad):
    _, model = toy_twin()
    with pytest.raises(ValueError, match="size"):
        ws.offload(model, gpu_memory=bad, device="cpu")


def test_unknown_block_list_name_is_refused():
    _, model = toy_twin()
    with pytest.raises(ws.WeightstreamError, match="no submodule named 'decoder'"):
        ws.offload(model, gpu_memory="1GB", device="cpu", blocks=["decoder"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_cuda_without_cuda_is_refused():
    _, model = toy_twin()
    with pytest.raises(ws.WeightstreamError, match="device='cpu'"):
        ws.offload(model, gpu_memory="1GB", device="cuda")


def test_a_compiled_forward_after_restore_says_what_to_do():
    _, model = toy_twin()
    handle = toy_streaming_all(model)
    engine_id = handle.engine.engine_id
    handle.restore()
    with pytest.raises(ws.OffloadStateError, match="compile or capture the model again"):
        ws.engine.ops.wait([torch.ones(2)], engine_id, 0)


# --- the planner's inputs ---------------------------------------------------------------------------

def test_a_given_profile_is_the_planners_only_machine_input(monkeypatch):
    """With profile= the placement depends on the arguments alone: the machine's own profile is never
    read (here it would raise), and the placement is the one the planner computes from that profile."""
    import dataclasses
    import importlib

    from weightstream.placement.plan import plan

    # where prepare() reads the profile
    offload_module = importlib.import_module("weightstream.placement.prepare")

    def no_machine(*args, **kwargs):
        raise AssertionError("the machine's profile was read")

    monkeypatch.setattr(offload_module, "load_profile", no_machine)
    # a machine whose link is 1000x slower than the H200's, for copies and zero-copy reads alike
    ref = ws.REFERENCE_PROFILE
    slow_link = dataclasses.replace(ref, copy_s_per_byte=ref.copy_s_per_byte * 1000,
                                    uva={m: s * 1000 for m, s in ref.uva.items()})
    budget = budget_for(toy_twin()[1], 0.6)
    for profile in (ws.REFERENCE_PROFILE, slow_link):
        _, model = toy_twin()
        handle = ws.offload(model, gpu_memory=budget, device="cpu", profile=profile)
        prep = offload_module.prepare(toy_twin()[1], budget, "cpu", profile=profile)
        assert handle.placement == prep.placement == plan(prep.cost, budget, 1, profile)
        handle.restore()
    fast = offload_module.prepare(toy_twin()[1], budget, "cpu", profile=ws.REFERENCE_PROFILE).placement
    slow = offload_module.prepare(toy_twin()[1], budget, "cpu", profile=slow_link).placement
    assert fast.prediction.ms < slow.prediction.ms  # the profile is what the prediction is made from


# --- the eager schedule: no op dispatch, no copies, but never a tensor that the next copy overwrites ---

class Peek(nn.Module):
    """A block that records the storage it computes from, scales its input in place (a block may), and
    returns its output together with a view of its own weight (a block may return one)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.seen: list[int] = []

    def forward(self, x):
        self.seen.append(x.untyped_storage().data_ptr())
        x.mul_(0.5)
        return torch.tanh(self.fc(x)), self.fc.weight[0]


class PeekModel(nn.Module):
    def __init__(self, n: int = 4, dim: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Peek(dim) for _ in range(n))

    def forward(self, x):
        rows, inputs = [], []
        for layer in self.layers:
            inputs.append(x)
            x, row = layer(x)
            rows.append(row)
        return x, rows, inputs


def check_peek_model(device: str, n: int, dim: int, forwards: int, **offload_kw) -> None:
    """Offload a PeekModel of `n` blocks with every block streaming through one slot and run
    `forwards` forwards against its resident twin on `device` (also the GPU test's body): the outputs
    and each block's weight row are exact; with `streamed.EAGER_DIRECT` the blocks computed from the
    caller's tensors, without it from the ops' copies."""
    direct = ws.engine.streamed.EAGER_DIRECT
    torch.manual_seed(0)
    ref = PeekModel(n, dim).to(device).eval().requires_grad_(False)
    model = copy.deepcopy(ref)
    with pytest.raises(ws.BudgetError) as info:
        ws.offload(model, gpu_memory=0, device=device, strategy="stream", **offload_kw)
    handle = ws.offload(model, gpu_memory=info.value.minimum_bytes, device=device, strategy="stream",
                        **offload_kw)
    assert handle.stats.groups == n and handle.stats.slots == 1  # every block through one slot
    with torch.no_grad():
        for _ in range(forwards):  # the first forward's prologue, then forwards prefetched by the one before
            a = torch.randn(8, dim, device=device)
            b = a.clone()
            out_ref, rows_ref, inputs_ref = ref(a)
            out, rows, inputs = model(b)
            assert torch.equal(out, out_ref)
            # each block's weight row, returned as a view of its slot, was copied before the next group
            # landed in that slot (the CPU backend copies at once: without it, every row would be the
            # last group's)
            for r, want in zip(rows, rows_ref, strict=True):
                assert torch.equal(r, want)
            # the blocks computed from the caller's tensors themselves and scaled them in place, as the
            # resident blocks did (a copy per block would have hidden the in-place scaling)
            if direct:
                assert torch.equal(b, a)
                assert all(torch.equal(x, y) for x, y in zip(inputs, inputs_ref, strict=True))
                seen = [x.untyped_storage().data_ptr() for x in inputs]
                assert [layer.seen[-1] for layer in model.layers] == seen
            else:  # the ops computed from copies: the caller's tensor kept its values
                assert not torch.equal(b, a)
    handle.restore()
    assert all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), ref.state_dict().values(),
                                                 strict=True))


@pytest.mark.parametrize("direct", [True, False])
def test_eager_blocks_see_the_callers_tensors_and_never_a_slot_the_next_copy_overwrites(direct, monkeypatch):
    """direct: the eager path (`ops.eager`); False: through the custom ops, as a compiled forward runs
    (their copies hide a block's in-place writes from the caller, but a weight view it returns must
    still be copied before the next group lands)."""
    monkeypatch.setattr(ws.engine.streamed, "EAGER_DIRECT", direct)
    check_peek_model("cpu", n=4, dim=16, forwards=2)


def test_on_the_cpu_auto_places_as_on_the_reference_gpu_and_stream_streams_as_the_readme_says():
    """README (Install): on the CPU backend `strategy="auto"` places blocks as the planner would on the
    reference H200 (the placement planned with ws.REFERENCE_PROFILE) and `strategy="stream"` always runs
    the streaming schedule; all exact."""
    from conftest import make_model

    from weightstream.placement.prepare import prepare

    readme = (__import__("pathlib").Path(__file__).parents[1] / "README.md").read_text()
    assert 'there `strategy="auto"` places blocks as on a reference H200; `strategy="stream"`' in readme
    ref = make_model("llama")
    ids = torch.randint(0, 100, (1, 6))
    expected = ref(ids).logits
    for fraction in (0.5, 0.65, 0.8):
        budget = int(weight_bytes(ref) * fraction)
        for strategy in ("auto", "stream"):
            model = copy.deepcopy(ref)
            want = prepare(copy.deepcopy(ref), budget, device="cpu", strategy=strategy,
                           profile=ws.REFERENCE_PROFILE).placement
            handle = ws.offload(model, gpu_memory=budget, device="cpu", strategy=strategy)
            assert handle.placement == want
            if strategy == "stream":
                assert handle.stats.streamed_bytes > 0 and handle.stats.uva_bytes == 0
            assert torch.equal(model(ids).logits, expected)
