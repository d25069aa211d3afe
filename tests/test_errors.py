"""Every mistake a user can make in an argument ends in a WeightstreamError subclass (from errors.py)
whose message says what to change: property tests over malformed sizes, dtypes, devices, paths."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_offload import Toy

import weightstream as ws
from weightstream import errors
from weightstream.dtypes import parse_dtype
from weightstream.sizes import parse_size

TOY = Toy().eval()
anything = st.one_of(st.text(max_size=20), st.binary(max_size=8), st.integers(-2**70, 2**70),
                     st.floats(allow_nan=True), st.none(), st.booleans(), st.lists(st.integers(), max_size=2))
size_text = st.builds(lambda n, unit, pad: f"{pad}{n}{unit}{pad}",
                      st.one_of(st.integers(-10, 10**30), st.floats()),
                      st.sampled_from(["", "B", "KB", "kib", "GiB", "gb", "TB", "PB", "bytes", "e3"]),
                      st.sampled_from(["", " ", "\t"]))


def test_every_error_class_is_a_weightstream_error():
    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)]
    assert {c.__name__ for c in classes} >= {"ArgumentError", "BudgetError", "CheckpointError",
                                            "InferenceOnlyError", "OffloadStateError", "PinnedMemoryError"}
    assert all(issubclass(c, ws.WeightstreamError) for c in classes)
    assert ws.CheckpointError is errors.CheckpointError  # one home, re-exported
    from weightstream.formats.checkpoint import CheckpointError

    assert CheckpointError is errors.CheckpointError


@settings(max_examples=300, deadline=None)
@given(size=st.one_of(anything, size_text))
def test_a_size_is_bytes_or_an_argument_error(size):
    try:
        nbytes = parse_size(size)
    except ws.ArgumentError as err:
        assert "size" in str(err) or "bytes" in str(err)
        return
    assert isinstance(nbytes, int) and 0 <= nbytes < 2**63


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.one_of(anything, size_text))
def test_offload_with_any_budget_offloads_or_raises_a_weightstream_error(size):
    model = copy.deepcopy(TOY)
    try:
        handle = ws.offload(model, gpu_memory=size, device="cpu", strategy="stream")
    except (ws.ArgumentError, ws.BudgetError):
        return
    handle.restore()


@settings(max_examples=200, deadline=None)
@given(dtype=st.one_of(anything, st.sampled_from(["bf16", "FP16", "torch.float32", " half ", "bfloat",
                                                   "int8", "float8", "torch.int64"]),
                       st.sampled_from([torch.int8, torch.bool, torch.float16, torch.complex64])))
def test_a_dtype_is_a_floating_dtype_or_an_argument_error(dtype):
    try:
        parsed = parse_dtype(dtype)
    except ws.ArgumentError as err:
        assert "dtype" in str(err) and "bfloat16" in str(err)  # says what it takes
        return
    assert isinstance(parsed, torch.dtype) and parsed.is_floating_point


@settings(max_examples=60, deadline=None)
@given(path=st.one_of(st.text(max_size=30), st.binary(max_size=10), st.integers(), st.none(),
                      st.sampled_from([".", "/", "/dev/null", "\x00", "a" * 5000, "~", ""])))
def test_any_path_that_is_no_checkpoint_raises_a_checkpoint_error(path):
    with pytest.raises(ws.CheckpointError, match="folder|config.json"):
        ws.from_pretrained(path, gpu_memory="1GB", device="cpu", progress=False)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    from conftest import make_model

    folder = tmp_path_factory.mktemp("llama")
    make_model("llama").save_pretrained(folder)
    return folder


def _fails(parse, value) -> bool:
    try:
        parse(value)
    except ValueError:
        return True
    return False


MALFORMED = {  # argument of from_pretrained: values that are mistakes by construction
    "dtype": st.one_of(st.text(max_size=12), st.integers()).filter(lambda v: _fails(parse_dtype, v)),
    "cpu_memory": st.one_of(st.text(max_size=12), st.integers(max_value=-1), st.floats()).filter(
        lambda v: _fails(parse_size, v)),
    "strategy": st.text(max_size=12).filter(lambda v: v not in ("auto", "stream", "uva")),
    "tokens": st.one_of(st.integers(max_value=0), st.floats(), st.text(max_size=4), st.booleans()),
    "device": st.text(max_size=12).filter(lambda v: not v.strip().startswith(("cpu", "cuda"))),
    "gpu_memory": st.one_of(st.text(max_size=12), st.integers(max_value=-1)).filter(
        lambda v: _fails(parse_size, v)),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), where=st.sampled_from(sorted(MALFORMED)))
def test_from_pretrained_with_a_malformed_argument_raises_a_weightstream_error(llama_folder, data, where):
    value = data.draw(MALFORMED[where])
    kwargs = {"gpu_memory": "1GB", "device": "cpu", "progress": False} | {where: value}
    with pytest.raises(ws.WeightstreamError):
        ws.from_pretrained(llama_folder, **kwargs)


@pytest.mark.parametrize("kwargs, says", [
    (dict(strategy="fast"), "strategy='fast'"), (dict(tokens=0), "tokens=0"),
    (dict(tokens=1.5), "tokens=1.5"),
    (dict(device="tpu"), "device='tpu'"), (dict(device="meta"), "'cuda' and 'cpu'"),
    (dict(profile="H200"), "MachineProfile"), (dict(blocks=["nothing"]), "no submodule"),
])
def test_offload_names_the_bad_argument(kwargs, says):
    with pytest.raises(ws.WeightstreamError, match=says.replace("(", r"\(").replace(".", r"\.")):
        ws.offload(copy.deepcopy(TOY), gpu_memory="1GB", **({"device": "cpu"} | kwargs))


def test_not_a_module_is_an_argument_error():
    with pytest.raises(ws.ArgumentError, match="nn.Module"):
        ws.offload({"weight": torch.ones(3)}, gpu_memory="1GB", device="cpu")
