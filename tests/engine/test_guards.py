"""What a user does with an offloaded model besides calling it: true weights out, or a clear refusal.

CPU tests through the real engine (synchronous backend); the last ones need a GPU (zero-copy views of
the pinned arena stand in for the slot views there).
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from conftest import hf_config, make_model, state_copy, weight_bytes
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

import weightstream as ws
from weightstream.engine.guards import live_parameters


def ids_for(seed: int = 0, batch: int = 2, length: int = 9, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (batch, length), generator=gen).to(device)


def as_transformers_gives_it(arch: str = "llama", seed: int = 0):
    """A model straight out of `from_config`: training mode, every parameter requiring gradients; and
    its resident reference in eval mode."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch))
    assert model.training and all(p.requires_grad for p in model.parameters())
    return model, copy.deepcopy(model).eval()


def offloaded(arch: str = "llama", strategy: str = "stream", fraction: float = 0.45):
    ref = make_model(arch)
    model = copy.deepcopy(ref)
    budget = int(weight_bytes(model) * fraction)
    handle = ws.offload(model, gpu_memory=budget, device="cpu", strategy=strategy)
    assert handle.stats.groups + len(handle.placement.uva) >= 2
    return ref, model, handle


def assert_same_tensors(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name].cpu(), want[name].cpu()), name


# --- gradients and training mode ------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_model_with_gradients_in_training_mode_offloads_runs_exactly_and_restores(arch):
    model, ref = as_transformers_gives_it(arch)
    handle = ws.offload(model, gpu_memory=int(weight_bytes(model) * 0.45), device="cpu", strategy="stream")
    assert not model.training and not any(p.requires_grad for p in live_parameters(model))
    with torch.no_grad():
        want = ref(ids_for()).logits
    assert torch.equal(model(ids_for()).logits, want)  # grad mode on, nothing requires grad: no graph
    with torch.no_grad():
        assert torch.equal(model(ids_for()).logits, want)
    handle.restore()
    assert model.training and all(p.requires_grad for p in model.parameters())
    assert all(m.training for m in model.modules())


def test_only_the_gradients_that_were_on_come_back():
    model, _ = as_transformers_gives_it()
    frozen = {n for n, p in model.named_parameters() if "embed" in n or "norm" in n}
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    model.model.layers[0].eval()
    handle = ws.offload(model, gpu_memory=int(weight_bytes(model) * 0.45), device="cpu")
    handle.restore()
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == frozen
    assert not model.model.layers[0].training and model.model.layers[1].training and model.training


def test_train_and_requires_grad_are_refused_eval_is_not():
    _, model, handle = offloaded()
    for call in (model.train, lambda: model.model.layers[1].train(True), model.requires_grad_,
                 lambda: model.model.layers[2].mlp.requires_grad_(True)):
        with pytest.raises(ws.InferenceOnlyError, match="inference only"):
            call()
    assert not model.training
    model.eval()
    model.requires_grad_(False)
    handle.restore()
    model.train()  # an ordinary module again


def test_autograd_through_streamed_weights_is_refused():
    ref, model, handle = offloaded()
    weight = live_parameters(model.model.layers[handle.placement.streamed[0]])[0]
    weight.requires_grad = True  # past the guards: straight on the tensor
    with pytest.raises(ws.InferenceOnlyError, match="inference only"):
        model(ids_for())
    with torch.no_grad():  # no autograd, no problem
        assert torch.equal(model(ids_for()).logits, ref(ids_for()).logits)
    model.requires_grad_(False)  # turns the live tensor's flag off too
    assert not weight.requires_grad
    embeds = ref.model.embed_tokens(ids_for()).requires_grad_(True)  # gradients w.r.t. the input
    with pytest.raises(ws.InferenceOnlyError, match="inference only"):
        model(inputs_embeds=embeds)


def test_autograd_under_compile_is_refused_with_the_same_message():
    _, model, handle = offloaded()
    compiled = torch.compile(model, fullgraph=True)
    embeds = model.model.embed_tokens(ids_for()).detach().requires_grad_(True)
    with pytest.raises(Exception, match="inference only"):
        compiled(inputs_embeds=embeds)
    torch._dynamo.reset()


# --- true weights out -------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["stream", "uva", "auto"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "mixtral"])
def test_state_dict_and_parameters_give_the_true_weights(arch, strategy):
    ref, model, handle = offloaded(arch, strategy)
    with torch.no_grad():
        model(ids_for())  # the slots now hold the last groups: anything read from them would differ
    want = state_copy(ref)
    assert_same_tensors(model.state_dict(), want)
    assert_same_tensors({k: v.detach() for k, v in model.state_dict(keep_vars=True).items()}, want)
    assert_same_tensors(dict(model.named_parameters()), dict(ref.named_parameters()))
    assert_same_tensors(dict(model.named_buffers()), dict(ref.named_buffers()))
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())
    assert [p.shape for p in model.parameters()] == [p.shape for p in ref.parameters()]
    name = handle.streamed_blocks[0] if handle.streamed_blocks else "model.layers.0"
    block = dict(model.named_modules()).get(name) or model.transformer.h[0]
    ref_block = dict(ref.named_modules()).get(name) or ref.transformer.h[0]
    assert_same_tensors(block.state_dict(), ref_block.state_dict())  # a submodule's state dict too
    with torch.no_grad():
        assert torch.equal(model(ids_for(1)).logits, ref(ids_for(1)).logits)  # reading changed nothing


def test_torch_save_of_the_state_dict_reloads_bit_for_bit():
    ref, model, _ = offloaded("llama")
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    fresh = make_model("llama", seed=7)
    fresh.load_state_dict(torch.load(buffer))
    assert_same_tensors(fresh.state_dict(), ref.state_dict())
    with torch.no_grad():
        assert torch.equal(fresh(ids_for()).logits, ref(ids_for()).logits)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_save_pretrained_writes_the_true_weights(arch, tmp_path):
    ref, model, _ = offloaded(arch)
    model.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert_same_tensors(back.state_dict(), ref.state_dict())


def test_a_disk_tier_state_dict_reads_the_true_weights_from_the_files(tmp_path):
    ref = make_model("llama")
    ref.save_pretrained(tmp_path, max_shard_size="60KB")
    load = dict(gpu_memory=int(weight_bytes(ref) * 0.4), device="cpu", progress=False, strategy="stream")
    group = ws.handle_of(ws.from_pretrained(tmp_path, **load)).stats.staging_bytes
    model = ws.from_pretrained(tmp_path, cpu_memory=3 * group, **load)
    assert ws.handle_of(model).stats.disk_bytes > 0
    assert_same_tensors(model.state_dict(), state_copy(ref))
    assert_same_tensors(dict(model.named_parameters()), dict(ref.named_parameters()))



@settings(max_examples=16, deadline=None)
@given(strategy=st.sampled_from(["stream", "uva"]), compress=st.booleans(),
       via=st.sampled_from(["parameters", "state_dict"]),
       picks=st.sets(st.integers(0, 40), min_size=1, max_size=4))
def test_a_write_through_the_tensors_parameters_or_state_dict_gave_acts_as_on_the_resident_model_or_raises(
        strategy, compress, via, picks):
    """A resident model's parameters() and state_dict() values are its weights: writing them in place
    edits the model. Offloaded, a raw streamed or zero-copy tensor's value is a view of its host bytes:
    the write reaches them and the next forward refills the slots from them (it read the stale slot
    once). A compressed group's value is a decoded copy: the write cannot reach the weights, and the
    next forward says so and leaves the weights as they were."""
    from weightstream.errors import OffloadStateError

    ref = make_model("llama", dtype=torch.bfloat16)  # bf16: what the codec compresses
    model = copy.deepcopy(ref)
    compress = compress and strategy == "stream"
    handle = ws.offload(model, gpu_memory=int(weight_bytes(model) * 0.75), device="cpu", strategy=strategy,
                        compress=compress)
    engine = handle.engine
    coded = {e.name for g, group in enumerate(engine.groups) if engine.wire[g] is not None for e, _ in group}
    assert bool(coded) == compress
    with torch.no_grad():
        model(ids_for())  # the slots hold the last groups, and the next forward's first ones
        mine = model.named_parameters() if via == "parameters" else model.state_dict().items()
        theirs = ref.parameters() if via == "parameters" else ref.state_dict().values()
        pairs = list(zip(mine, theirs, strict=True))
        picked = [pairs[i % len(pairs)] for i in sorted(picks)]
        for (_, t), _ in picked:
            t.mul_(0.5)
        for (name, _), r in picked:
            if name not in coded:  # reached the weights, as on the reference
                r.mul_(0.5)
        if any(name in coded for (name, _), _ in picked):
            with pytest.raises(OffloadStateError, match="was a copy and the write never reached"):
                model(ids_for(1))
        for seed in (1, 2):
            assert torch.equal(model(ids_for(seed)).logits, ref(ids_for(seed)).logits)
    assert_same_tensors(model.state_dict(), state_copy(ref))


@pytest.mark.parametrize("strategy", ["stream", "uva"])
def test_giving_a_parameter_of_parameters_other_memory_is_refused_and_changes_nothing(strategy):
    """On a resident model `p.data = other` (vector_to_parameters) replaces the weight; the tensors
    parameters() gives for weights kept off the GPU are their true bytes, which that would not reach."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    from weightstream.engine.guards import TrueWeight
    from weightstream.errors import OffloadStateError

    ref, model, _ = offloaded(strategy=strategy)
    with pytest.raises(OffloadStateError, match=r"vector_to_parameters does\) would not reach the model"):
        vector_to_parameters(parameters_to_vector(model.parameters()) * 0.5, model.parameters())
    refused = 0
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):  # as far as it got: one by one
        new = r.data * 0.5
        if isinstance(p, TrueWeight):
            with pytest.raises(OffloadStateError, match="would not reach the model"):
                p.data = new
            refused += 1
        else:  # resident: replaced, as on the reference
            p.data = new
            r.data = new.clone()
    assert refused == len([e for g in (*_.engine.groups, *_.engine.uva_groups) for e, _s in g])
    with torch.no_grad():
        assert torch.equal(model(ids_for()).logits, ref(ids_for()).logits)
    assert_same_tensors(model.state_dict(), state_copy(ref))

# --- refused: what would copy or overwrite the slots -------------------------------------------------

@pytest.mark.parametrize("what", ["deepcopy", "deepcopy a block", "torch.save", "pickle", "load_state_dict"])
def test_copying_pickling_and_loading_into_an_offloaded_model_are_refused(what):
    ref, model, handle = offloaded()
    block = model.model.layers[handle.placement.streamed[0]]
    calls = {
        "deepcopy": lambda: copy.deepcopy(model),
        "deepcopy a block": lambda: copy.deepcopy(block),
        "torch.save": lambda: torch.save(model, io.BytesIO()),
        "pickle": lambda: pickle.dumps(model),
        "load_state_dict": lambda: model.load_state_dict(ref.state_dict()),
    }
    with pytest.raises(ws.OffloadStateError, match=r"handle.restore\(\)"):
        calls[what]()
    with torch.no_grad():
        assert torch.equal(model(ids_for()).logits, ref(ids_for()).logits)
    handle.restore()
    twin = copy.deepcopy(model)  # an ordinary module again
    with torch.no_grad():
        assert torch.equal(twin(ids_for()).logits, ref(ids_for()).logits)


# --- on a GPU: the true weights are zero-copy views of the pinned arena ---------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["stream", "auto"])
def test_on_the_gpu_state_dict_parameters_and_save_give_the_true_weights(strategy, tmp_path):
    ref = make_model("llama", dtype=torch.bfloat16).cuda()
    model = copy.deepcopy(ref)
    handle = ws.offload(model, gpu_memory=weight_bytes(model) // 2, strategy=strategy,
                        profile=ws.REFERENCE_PROFILE)
    with torch.no_grad():
        model(ids_for(device="cuda"))
    torch.cuda.synchronize()
    off_gpu = {n for n, t in model.state_dict().items() if not t.is_cuda}  # host tensors of the arena
    assert off_gpu and len(off_gpu) < len(model.state_dict()) and all("layers" in n for n in off_gpu)
    assert_same_tensors(model.state_dict(), state_copy(ref))
    assert_same_tensors(dict(model.named_parameters()), dict(ref.named_parameters()))
    model.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert_same_tensors(back.state_dict(), ref.state_dict())
    with pytest.raises(ws.OffloadStateError):
        copy.deepcopy(model)
    embeds = ref.model.embed_tokens(ids_for(device="cuda")).detach().requires_grad_(True)
    if handle.placement.streamed:  # the refusal lives in the schedule ops; zero-copy blocks have none
        with pytest.raises(ws.InferenceOnlyError):
            model(inputs_embeds=embeds)
    before = model.state_dict()
    handle.restore()
    assert_same_tensors(model.state_dict(), state_copy(ref))
    assert_same_tensors(before, state_copy(ref))  # what was handed out stays valid after restore


# --- tensors rebound, shared, or given gradients after offload ------------------------------------------

@pytest.mark.parametrize("how", ["data", "parameter"])
def test_a_zero_copy_weight_rebound_after_offload_is_what_state_dict_parameters_and_restore_give(how):
    """`module.weight.data = new` (as PEFT's safe_merge does) or `module.weight = nn.Parameter(new)` on
    weights read in place: the forward reads the new tensor, and so do state_dict(), parameters() and
    restore() (they gave the old arena bytes), as on the resident model."""
    ref, model, handle = offloaded(strategy="uva")
    assert handle.placement.uva

    def rebind(module):
        if isinstance(module, torch.nn.Linear) and module.out_features == 96:  # the MLP's up and gate
            new = torch.randn_like(module.weight)
            if how == "data":
                module.weight.data = new
            else:
                module.weight = torch.nn.Parameter(new, requires_grad=False)

    for m in (ref, model):
        torch.manual_seed(3)
        m.apply(rebind)
    with torch.no_grad():
        assert torch.equal(model(ids_for()).logits, ref(ids_for()).logits)
    assert_same_tensors(model.state_dict(), state_copy(ref))
    assert_same_tensors(dict(model.named_parameters()), dict(ref.named_parameters()))
    handle.restore()
    assert_same_tensors(model.state_dict(), state_copy(ref))
    with torch.no_grad():
        assert torch.equal(model(ids_for(1)).logits, ref(ids_for(1)).logits)


def test_a_tensor_another_offloaded_model_holds_is_refused_and_free_once_that_one_is_restored():
    """Two models sharing one Parameter object: offloading the second moved the shared object's memory
    to its own slot, so both read the wrong bytes. Refused, naming the tensor; once the first is
    restored the second offloads and both are exact."""
    ref_a, a = make_model("llama"), make_model("llama")
    b = make_model("llama", seed=2)
    b.model.layers[3].mlp.up_proj.weight = a.model.layers[3].mlp.up_proj.weight  # shared before offload
    ref_b = copy.deepcopy(b)
    ref_b.model.layers[3].mlp.up_proj.weight = ref_a.model.layers[3].mlp.up_proj.weight
    handle_a = ws.offload(a, gpu_memory=int(weight_bytes(a) * 0.45), device="cpu", strategy="stream")
    with torch.no_grad():
        a(ids_for())  # its slots now hold other blocks' bytes
    with pytest.raises(ws.OffloadStateError, match="model.layers.3.mlp.up_proj.weight is the very tensor"):
        ws.offload(b, gpu_memory=int(weight_bytes(b) * 0.45), device="cpu", strategy="stream")
    with torch.no_grad():
        assert torch.equal(a(ids_for()).logits, ref_a(ids_for()).logits)
    handle_a.restore()
    handle_b = ws.offload(b, gpu_memory=int(weight_bytes(b) * 0.45), device="cpu", strategy="stream")
    with torch.no_grad():
        assert torch.equal(b(ids_for()).logits, ref_b(ids_for()).logits)
    handle_b.restore()
    with torch.no_grad():
        assert torch.equal(a(ids_for()).logits, ref_a(ids_for()).logits)
        assert torch.equal(b(ids_for()).logits, ref_b(ids_for()).logits)


@pytest.mark.parametrize("how", ["attribute", "method"])
def test_turning_on_the_gradient_of_a_weight_parameters_gave_is_refused(how):
    """The forward reads the slots, not the tensor parameters() gives for a weight kept off the GPU, so
    its gradient would stay None where the resident model's is computed: refused."""
    ref, model, handle = offloaded()
    off_gpu = [p for p in model.parameters() if type(p).__name__ == "TrueWeight"]
    assert off_gpu
    with pytest.raises(ws.InferenceOnlyError, match="inference only"):
        if how == "attribute":
            off_gpu[0].requires_grad = True
        else:
            off_gpu[0].requires_grad_()
    off_gpu[0].requires_grad_(False)  # turning it off is what it is already: allowed
    with torch.no_grad():
        assert torch.equal(model(ids_for()).logits, ref(ids_for()).logits)


@pytest.mark.parametrize("assign", [False, True])
def test_loading_through_a_wrapper_made_after_offload_is_refused_before_anything_is_written(assign):
    """`nn.ModuleDict({"lm": model}).load_state_dict(...)` reaches the model through its own
    `_load_from_state_dict`: refused as `model.load_state_dict` is, before any of its tensors (resident
    ones included) is written, so the model stays exact."""
    ref, model, handle = offloaded()
    other = make_model("llama", seed=5)
    wrapper = torch.nn.ModuleDict({"lm": model})
    with pytest.raises(ws.OffloadStateError, match="load_state_dict would write"):
        wrapper.load_state_dict({"lm." + k: v.clone() for k, v in other.state_dict().items()}, assign=assign)
    with torch.no_grad():
        assert torch.equal(model(ids_for()).logits, ref(ids_for()).logits)
    assert_same_tensors(model.state_dict(), state_copy(ref))
    assert id(model.lm_head.weight) not in handle.engine.guards._true  # outside the blocks: resident
    wrapper.load_state_dict({"lm.lm_head.weight": other.lm_head.weight.clone()}, strict=False)
    ref.lm_head.weight.data.copy_(other.lm_head.weight)  # a resident tensor loads as torch does
    with torch.no_grad():
        assert torch.equal(model(ids_for()).logits, ref(ids_for()).logits)
