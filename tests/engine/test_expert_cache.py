"""The GPU expert cache on the CPU (synchronous backend, the torch copy in place of the Triton kernel):
its index table against a plain Python statement of the policy under drawn routing sequences, the rows
it copies, and mixtures of experts offloaded with a cache `torch.equal` to the resident model while
their caches fill and replace."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
from conftest import run_interpreted
from hypothesis import given, settings
from hypothesis import strategies as st
from model_zoo import ZOO, call, same
from torch.utils._python_dispatch import TorchDispatchMode

import weightstream as ws
from weightstream.engine.expert_cache import CachedTensor, CacheTable, ExpertCache, copy_rows_reference
from weightstream.errors import ArgumentError
from weightstream.placement.plan import placement_of, plan
from weightstream.placement.prepare import prepare


class Policy:
    """The cache policy stated plainly, one call at a time: frequency while filling, then least recently
    used; ties to the cached expert, then the more frequent, then the lower index; never-routed experts
    never cached; the k-th admitted expert (by index) into the k-th free slot (by index)."""

    def __init__(self, experts: int, slots: int, fill_calls: int) -> None:
        self.experts, self.slots, self.fill_calls = experts, slots, fill_calls
        self.table: dict[int, int] = {}
        self.owner: list[int | None] = [None] * slots
        self.freq, self.last, self.calls = [0] * experts, [0] * experts, 0

    def step(self, routed: set[int]) -> tuple[set[int], list[int]]:
        self.calls += 1
        for e in routed:
            self.freq[e] += 1
            self.last[e] = self.calls
        primary = self.freq if self.calls <= self.fill_calls else self.last
        used = [e for e in range(self.experts) if self.freq[e] > 0]
        used.sort(key=lambda e: (primary[e], e in self.table, self.freq[e], -e), reverse=True)
        desired = set(used[: self.slots])
        hits = routed & set(self.table)
        for e in set(self.table) - desired:
            self.owner[self.table.pop(e)] = None
        admitted = sorted(desired - set(self.table))
        free = [s for s in range(self.slots) if self.owner[s] is None]
        for e, s in zip(admitted, free, strict=False):
            self.table[e], self.owner[s] = s, e
        return hits, admitted


routings = st.integers(2, 12).flatmap(lambda experts: st.tuples(
    st.just(experts), st.integers(1, experts), st.integers(0, 4),
    st.lists(st.lists(st.integers(0, experts - 1), min_size=1, max_size=6), min_size=1, max_size=30)))


@settings(max_examples=150, deadline=None)
@given(routings)
def test_the_table_follows_the_policy_and_stays_an_injective_map(drawn):
    """Every call: the table equals the plain policy's, maps experts to distinct slots, the owners are
    its inverse, only routed experts are cached, and hits, reached experts and host rows are counted."""
    experts, slots, fill_calls, calls = drawn
    table = CacheTable(experts, slots, torch.device("cpu"), fill_calls)
    policy = Policy(experts, slots, fill_calls)
    hits = reached = host_rows = 0
    for chosen in calls:
        routed = set(chosen)
        index = torch.tensor(chosen).view(-1, 1)  # one token per choice, top-1
        step = table.step(table.routed(index), index.shape[0])
        want_hits, admitted = policy.step(routed)
        assert step.routed.nonzero().flatten().tolist() == sorted(routed)
        assert step.hit.nonzero().flatten().tolist() == sorted(want_hits)
        assert step.admit.nonzero().flatten().tolist() == admitted
        got = {e: s for e, s in enumerate(table.table.tolist()) if s >= 0}
        assert got == policy.table and step.slot.tolist() == table.table.tolist()
        assert len(set(got.values())) == len(got) <= slots and all(0 <= s < slots for s in got.values())
        owner = table.owner.tolist()
        assert owner[slots] == -1 and {s: e for s, e in enumerate(owner[:slots]) if e >= 0} == \
            {s: e for e, s in got.items()}
        assert all(table.freq[e] > 0 for e in got)
        hits, reached = hits + len(want_hits), reached + len(routed)
        host_rows += len(admitted) + len(routed - set(got))
    assert table.counts.tolist() == [len(calls), sum(len(c) for c in calls), reached, hits, host_rows]


class _HostValues(TorchDispatchMode):
    """Records every tensor made from a Python value (`aten.lift_fresh`): an indexed assignment of a
    number (`t[i] = -1`) or `torch.tensor(...)`. On a GPU such a tensor is made in host memory and copied
    over, which a CUDA graph cannot capture and which synchronizes outside one."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_table_update_makes_no_tensor_from_a_python_value():
    """The table's update is device work only (numbers go in as kernel arguments), so on a GPU a CUDA
    graph captures it and it never waits for the host."""
    table = CacheTable(8, 3, torch.device("cpu"))
    index = torch.tensor([[0, 1], [1, 3]])
    with _HostValues() as mode:
        for _ in range(3):
            table.step(table.routed(index), tokens=2)
    assert mode.ops == []


def test_the_cache_fills_by_frequency_then_replaces_the_least_recently_used():
    table = CacheTable(6, 2, torch.device("cpu"), fill_calls=3)
    for chosen in ([5, 4], [4, 3], [4, 3]):  # filling: 4 (3 calls) and 3 (2 calls) beat 5 (1 call)
        table.step(table.routed(torch.tensor([chosen])), 1)
    assert {e for e, s in enumerate(table.table.tolist()) if s >= 0} == {3, 4}
    table.step(table.routed(torch.tensor([[0, 4]])), 1)  # LRU now: 0 replaces 3, used before 4
    assert {e for e, s in enumerate(table.table.tolist()) if s >= 0} == {0, 4}
    table.step(table.routed(torch.tensor([[1, 2]])), 1)  # two new ones push both out
    assert {e for e, s in enumerate(table.table.tolist()) if s >= 0} == {1, 2}


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.data())
def test_copy_rows_reference_copies_the_rows_its_table_names(n, data):
    rows0, rows1, width = (data.draw(st.integers(1, limit)) for limit in (6, 6, 9))
    gen = torch.Generator().manual_seed(n)
    src0 = torch.randint(0, 256, (rows0, width), generator=gen, dtype=torch.uint8)
    src1 = torch.randint(0, 256, (rows1, width), generator=gen, dtype=torch.uint8)
    out_rows = data.draw(st.integers(1, 8))
    # distinct destinations (as the cache's tables always are), some skipped
    dst_row = data.draw(st.permutations(list(range(max(n, out_rows)))))[:n]
    dst_row = [d if d < out_rows else -1 for d in dst_row]
    which = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    src_row = [data.draw(st.integers(0, (rows1 if w else rows0) - 1)) for w in which]
    dst = torch.zeros(out_rows, width, dtype=torch.uint8)
    want = dst.clone()
    for d, s, w in zip(dst_row, src_row, which, strict=True):
        if d >= 0:
            want[d] = (src1 if w else src0)[s]
    copy_rows_reference(dst, src0, src1, torch.tensor(dst_row), torch.tensor(src_row), torch.tensor(which))
    assert torch.equal(dst, want)


def test_gather_copies_routed_rows_and_keeps_the_pool_true():
    """Through a sequence of calls: the work rows of routed experts and the pool rows of cached ones
    hold the host's bytes, the rows of other experts are left alone."""
    experts, slots = 7, 3
    gen = torch.Generator().manual_seed(0)
    host = [torch.randint(0, 256, (experts, w), generator=gen, dtype=torch.uint8) for w in (12, 5)]
    tensors = [CachedTensor(None, h, torch.zeros(slots, h.shape[1], dtype=torch.uint8),
                            torch.full_like(h, 7)) for h in host]
    cache = ExpertCache(torch.nn.Identity(), tensors, CacheTable(experts, slots, torch.device("cpu"), 2))
    for chosen in ([[1, 2], [2, 5]], [[6, 1]], [[0, 3], [4, 1]], [[2, 2]], [[5, 6]]):
        for t in tensors:
            t.work.fill_(7)
        cache.gather(torch.tensor(chosen))
        routed = {e for row in chosen for e in row}
        table = cache.table.table.tolist()
        for t, h in zip(tensors, host, strict=True):
            for e in range(experts):
                assert torch.equal(t.work[e], h[e] if e in routed else torch.full_like(h[e], 7))
                if table[e] >= 0:
                    assert torch.equal(t.pool[table[e]], h[e])


# mixtures of experts the cache takes (Mixtral's and Qwen3-MoE's shapes first)
CACHED = ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v2", "gpt_oss"]


def cached_offload(model, slots: int, fill_calls: int = 2, uncached_first: bool = False):
    """Offload with every block's routed experts read in place behind a cache of `slots` slots (the
    first such block read in place without a cache, with `uncached_first`)."""
    cost = prepare(model, gpu_memory=2**40, device="cpu").cost
    apart = tuple(i for i in range(len(cost.block_bytes)) if cost.experts_apart(i))
    cached = apart[1:] if uncached_first else apart
    placement = placement_of(cost, (), 0, apart, uva_experts=apart, expert_cache=cached, expert_slots=slots)
    handle = ws.offload(model, gpu_memory=placement.gpu_bytes, device="cpu", placement=placement)
    for cache in handle.expert_caches.caches:
        cache.table.fill_calls = fill_calls
    return handle, cost


def inputs_like(inputs, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return dict(inputs, input_ids=torch.randint(0, 128, inputs["input_ids"].shape, generator=gen))


@pytest.mark.parametrize("uncached_first", [False, True])
@pytest.mark.parametrize("name", CACHED)
def test_offloaded_with_an_expert_cache_is_exact_while_it_fills_and_replaces(name, uncached_first):
    model, inputs = ZOO[name]()
    model = model.eval().requires_grad_(False)
    ref = copy.deepcopy(model)
    handle, cost = cached_offload(model, slots=2, uncached_first=uncached_first)
    assert handle.placement.expert_cache and handle.stats.cache_bytes == handle.placement.cache_bytes
    caches = handle.expert_caches
    assert caches.pool_bytes + caches.work_bytes == handle.placement.cache_bytes
    for seed in range(6):  # fill (2 calls per layer), then LRU replacement on new routings
        batch = inputs_like(inputs, seed)
        assert same(call(model, batch), call(ref, batch)), seed
    counts = caches.counts()
    assert counts["calls"] == 6 * len(caches.caches) and 0 < counts["hits"] < counts["reached"]
    assert handle.stats.expert_hit_rate == counts["hits"] / counts["reached"]
    # a decode step (one token) and a longer prefill through the same caches
    for batch in (dict(inputs, input_ids=inputs["input_ids"][:, :1]), inputs_like(inputs, 9)):
        assert same(call(model, batch), call(ref, batch))
    restores_true_state(handle, model, ref, inputs)


def restores_true_state(handle, model, ref, inputs) -> None:
    """The state dict holds the true values (not the work buffers), and after `restore()` the model is
    exact and carries no pre-hook."""
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)
    handle.restore()
    assert same(call(model, inputs), call(ref, inputs))
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_the_experts_read_the_cache_and_never_the_rows_of_experts_not_routed():
    """Poisoning the work rows before each gather (NaN) changes nothing: every row the experts read was
    copied for this call. Poisoning a cached slot changes the output: hits are read from the pool."""
    model, inputs = ZOO["mixtral"]()
    model = model.eval().requires_grad_(False)
    ref = copy.deepcopy(model)
    handle, _ = cached_offload(model, slots=3, fill_calls=1)
    caches = handle.expert_caches
    poison = torch.full((), float("nan"))

    def poison_work(module, args):
        for buffers in caches.work.values():
            for w in buffers:
                w.view(torch.float32).copy_(poison)

    hooks = [c.module.register_forward_pre_hook(poison_work, prepend=True) for c in caches.caches]
    for seed in range(3):
        batch = inputs_like(inputs, seed)
        assert same(call(model, batch), call(ref, batch))
    for h in hooks:
        h.remove()
    assert caches.hit_rate() > 0
    for cache in caches.caches:
        for t in cache.tensors:
            t.pool.view(torch.float32).mul_(2)
    batch = inputs_like(inputs, 1)
    assert not same(call(model, batch), call(ref, batch))
    handle.restore()


def test_expert_bytes_per_token_count_what_the_caches_read_from_host_memory():
    model, inputs = ZOO["qwen3_moe"]()
    model = model.eval().requires_grad_(False)
    handle, cost = cached_offload(model, slots=2, uncached_first=True)
    call(model, inputs)
    handle.count_experts()  # starts the caches' counts from zero too
    assert handle.expert_caches.counts()["calls"] == 0
    for seed in range(3):
        call(model, inputs_like(inputs, seed))
    per_expert = cost.routed_bytes[handle.placement.expert_cache[0]] // cost.experts
    rows = sum(c.table.counts[4].item() for c in handle.expert_caches.caches)
    tokens = inputs["input_ids"].numel() * 3
    uncached = handle._experts.counts[0, 0].item() * per_expert  # the uncached block: experts reached
    assert handle.stats.expert_bytes_per_token == pytest.approx((rows * per_expert + uncached) / tokens)
    handle.restore()


def test_compiled_fullgraph_runs_the_gather_as_an_opaque_op():
    """torch.compile(fullgraph=True) traces the pre-hooks into the custom op (aot_eager: the tracing and
    functionalization a real backend gets, without compiling kernels): equal to the eager forward."""
    model, inputs = ZOO["mixtral"]()
    model = model.eval().requires_grad_(False)
    ref = copy.deepcopy(model)
    handle, _ = cached_offload(model, slots=2)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for seed in range(3):
        batch = inputs_like(inputs, seed)
        assert same(call(compiled, batch), call(ref, batch))
    assert handle.expert_caches.counts()["calls"] == 3 * len(handle.expert_caches.caches)
    torch._dynamo.reset()
    handle.restore()


def test_placements_refuse_a_cache_outside_the_blocks_read_for_their_experts():
    model, _ = ZOO["mixtral"]()
    cost = prepare(model, gpu_memory=2**40, device="cpu").cost
    apart = tuple(range(len(cost.block_bytes)))
    with pytest.raises(ArgumentError, match="expert_cache"):
        placement_of(cost, (), 0, apart, uva_experts=apart[1:], expert_cache=apart[:1], expert_slots=1)
    with pytest.raises(ArgumentError, match="expert_cache"):
        placement_of(cost, (), 0, apart, uva_experts=apart, expert_cache=apart, expert_slots=0)
    with pytest.raises(ArgumentError, match="expert_cache"):
        placement_of(cost, (), 0, apart, uva_experts=apart, expert_cache=apart, expert_slots=cost.experts + 1)


def test_the_cost_model_predicts_fewer_link_bytes_with_more_slots():
    model, _ = ZOO["mixtral"]()
    cost = prepare(model, gpu_memory=2**40, device="cpu").cost
    apart = tuple(range(len(cost.block_bytes)))
    bytes_ = [placement_of(cost, (), 0, apart, uva_experts=apart, expert_cache=apart if s else (),
                           expert_slots=s).prediction.link_bytes for s in range(cost.experts + 1)]
    assert all(a > b for a, b in zip(bytes_[1:], bytes_[2:], strict=False)) and bytes_[-1] == 0


def test_the_kernel_run_by_tritons_interpreter_matches_the_reference():
    """The Triton row copy's own code run by Triton's interpreter on the CPU (a fresh Python with
    TRITON_INTERPRET=1) against `copy_rows_reference`."""
    pytest.importorskip("triton")
    run = run_interpreted(Path(__file__).parent, "import interpreted_expert_gather as m; "
                          "m.check_random_tables()")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


# The reference profile without the gather's fixed device cost (0.26 ms a cached layer, measured on an
# H100): next to it the zoo's tiny layers cost microseconds, so no cache would ever pay; the planner's
# trade of slots against resident experts is tested with it at 0 (and the fixed cost on its own below).
NO_GATHER_COST = dataclasses.replace(ws.REFERENCE_PROFILE, expert_gather_seconds=0.0)


@pytest.mark.parametrize("tokens", [1, 2048])
def test_the_planner_caches_experts_only_where_the_cost_model_says_it_pays(tokens):
    """Budgets between the dense bytes and the whole model, experts read in place. Under the cost model's
    uniform routing a slot saves what a resident expert saves, and the work buffer costs more, so at one
    token no cache is chosen; at 2048 tokens copying the routed experts beats reading them in place, and
    the planner caches. Every placement fits its budget, cache included, and is exact."""
    model, inputs = ZOO["mixtral"]()
    model = model.eval().requires_grad_(False)
    cost = prepare(model, gpu_memory=2**40, device="cpu").cost
    dense = cost.fixed_bytes + sum(b - r for b, r in zip(cost.block_bytes, cost.routed_bytes, strict=True))
    chosen = []
    for extra in (0.3, 0.6, 0.9):
        budget = dense + int(extra * sum(cost.routed_bytes))
        p = plan(cost, budget, tokens=tokens, profile=NO_GATHER_COST, strategy="uva")
        without = plan(cost, budget, tokens=tokens, profile=NO_GATHER_COST, strategy="uva",
                       expert_cache=False)
        assert p.gpu_bytes <= budget and p.prediction.again_ms <= without.prediction.again_ms
        chosen.append(p.expert_slots)
        if p.expert_cache:
            twin = copy.deepcopy(model)
            handle = ws.offload(twin, gpu_memory=budget, device="cpu", placement=p)
            assert handle.stats.cache_bytes == p.cache_bytes
            for seed in range(3):
                batch = inputs_like(inputs, seed)
                assert same(call(twin, batch), call(model, batch))
            handle.restore()
    assert any(chosen) == (tokens > 1), chosen


def test_the_gathers_fixed_cost_is_in_the_prediction_and_keeps_a_cache_off_where_it_outweighs_it():
    """Each cached layer's table update and gather costs `profile.expert_gather_seconds` a forward, bytes
    aside: a cached placement is predicted that much slower per cached layer, and on a tiny model,
    whose layers cost microseconds, the measured 0.26 ms keeps the planner from caching at all."""
    from weightstream.placement.cost import predict

    model, _ = ZOO["mixtral"]()
    cost = prepare(model.eval(), gpu_memory=2**40, device="cpu").cost
    dense = cost.fixed_bytes + sum(b - r for b, r in zip(cost.block_bytes, cost.routed_bytes, strict=True))
    budget = dense + int(0.6 * sum(cost.routed_bytes))
    cached = plan(cost, budget, tokens=2048, profile=NO_GATHER_COST, strategy="uva")
    assert cached.expert_cache
    placed = {k: getattr(cached, k) for k in ("uva_experts", "expert_cache", "expert_slots", "part")}
    args = (cost, cached.streamed, cached.n_slots, cached.uva, 2048)
    slower, faster = (predict(*args, p, **placed) for p in (ws.REFERENCE_PROFILE, NO_GATHER_COST))
    extra = len(cached.expert_cache) * ws.REFERENCE_PROFILE.expert_gather_seconds * 1e3
    assert slower.ms == pytest.approx(faster.ms + extra)
    assert slower.warm_ms == pytest.approx(faster.warm_ms + extra)
    assert not plan(cost, budget, tokens=2048, profile=ws.REFERENCE_PROFILE, strategy="uva").expert_cache


def test_offload_expert_cache_false_plans_no_cache_where_the_default_plans_one():
    """`offload(..., expert_cache=False)` (also through an OffloadConfig): the same budget, tokens and
    strategy that get a cache by default get none; both exact. A value other than a bool is refused."""
    model, inputs = ZOO["mixtral"]()
    model = model.eval().requires_grad_(False)
    cost = prepare(model, gpu_memory=2**40, device="cpu").cost
    dense = cost.fixed_bytes + sum(b - r for b, r in zip(cost.block_bytes, cost.routed_bytes, strict=True))
    budget = dense + int(0.6 * sum(cost.routed_bytes))
    batch = inputs_like(inputs, 0)
    expected = call(model, batch)
    cache_bytes = {}
    for switch in (True, False):
        twin = copy.deepcopy(model)
        config = ws.OffloadConfig(budget, device="cpu", tokens=2048, strategy="uva", expert_cache=switch,
                                  profile=NO_GATHER_COST)
        handle = ws.offload(twin, config)
        cache_bytes[switch] = handle.stats.cache_bytes
        assert same(call(twin, batch), expected)
        handle.restore()
    assert cache_bytes[True] > 0 and cache_bytes[False] == 0
    with pytest.raises(ws.ArgumentError, match="expert_cache='no': give True"):
        ws.offload(copy.deepcopy(model), budget, device="cpu", expert_cache="no")


@given(experts=st.integers(2, 64), data=st.data())
@settings(max_examples=30, deadline=None)
def test_zipf_popularity_is_a_sorted_distribution_that_grows_more_skewed_with_the_exponent(experts, data):
    from weightstream.placement.experts import zipf_popularity

    top_k = data.draw(st.integers(1, experts - 1))
    uniform = zipf_popularity(experts, top_k, 0.0)
    assert uniform == (1.0 / experts,) * experts
    shares = [zipf_popularity(experts, top_k, s) for s in (0.5, 1.5)]
    for p in shares:
        assert abs(sum(p) - 1.0) < 1e-9 and list(p) == sorted(p, reverse=True)
        assert max(p) <= 1.0 / top_k + 1e-9  # a token picks an expert at most once
    k = data.draw(st.integers(1, experts))
    assert sum(uniform[:k]) <= sum(shares[0][:k]) + 1e-9 <= sum(shares[1][:k]) + 2e-9


def test_a_skewed_routing_lets_the_planner_cache_experts_at_decode_and_it_runs_exactly():
    """At one token per forward under uniform routing a slot serves only its share and the planner
    caches nothing; told the routing is Zipf(2) it caches the popular experts at some budget, predicted
    no slower than the uniform choice costed under the same popularity; the placement is exact."""
    import dataclasses

    from weightstream.placement.experts import zipf_popularity

    model, inputs = ZOO["mixtral"]()
    model = model.eval().requires_grad_(False)
    cost = prepare(model, gpu_memory=2**40, device="cpu").cost
    skewed = dataclasses.replace(cost, popularity=zipf_popularity(cost.experts, cost.top_k, 2.0))
    assert skewed.cache_hit(1) > cost.cache_hit(1) == 1 / cost.experts
    dense = cost.fixed_bytes + sum(b - r for b, r in zip(cost.block_bytes, cost.routed_bytes, strict=True))
    cached = []
    for extra in (0.2, 0.4, 0.6, 0.8):
        budget = dense + int(extra * sum(cost.routed_bytes))
        uniform = plan(cost, budget, tokens=1, profile=NO_GATHER_COST, strategy="uva")
        told = plan(cost, budget, tokens=1, profile=NO_GATHER_COST, strategy="uva", routing_skew=2.0)
        assert not uniform.expert_cache
        same_under_skew = placement_of(skewed, uniform.streamed, uniform.n_slots, uniform.uva,
                                       uniform.part, 1, NO_GATHER_COST, budget=budget, strategy="uva",
                                       uva_experts=uniform.uva_experts)
        assert told.prediction.again_ms <= same_under_skew.prediction.again_ms + 1e-9
        if told.expert_cache:
            cached.append(told)
            twin = copy.deepcopy(model)
            handle = ws.offload(twin, gpu_memory=budget, device="cpu", placement=told)
            for seed in range(3):
                batch = inputs_like(inputs, seed)
                assert same(call(twin, batch), call(model, batch))
            handle.restore()
    assert cached


@pytest.mark.parametrize("skew", [-1.0, float("nan"), True, "high"])
def test_a_routing_skew_that_is_not_a_zipf_exponent_is_refused(skew):
    with pytest.raises(ArgumentError, match="routing_skew=.*give the Zipf exponent"):
        ws.OffloadConfig(2**20, device="cpu", routing_skew=skew)


@pytest.mark.parametrize("skew", [0.0, 1.5])
def test_routing_skew_fits_the_zipf_exponent_the_routers_were_given(skew):
    """A Qwen3-MoE of 32 experts, top 4, its routers made to draw from Zipf(skew) (the bench's synthetic
    routing), offloaded with its experts read in place: after `count_experts()` and a few forwards,
    `handle.routing_skew()` gives back about that exponent; None before counting. Exact throughout."""
    from conftest import wide_moe

    from weightstream.bench.causal_lm import skew_routing

    ref = wide_moe()
    skew_routing(ref, skew, seed=0)
    model = copy.deepcopy(ref)
    handle = ws.offload(model, gpu_memory=sum(p.nbytes for p in model.parameters()) // 3, device="cpu",
                        strategy="uva")
    assert handle.routing_skew() is None
    handle.count_experts()
    assert handle.routing_skew() is None  # nothing counted yet
    for seed in range(4):
        ids = torch.randint(0, 512, (1, 128), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            assert torch.equal(model(ids, use_cache=False).logits, ref(ids, use_cache=False).logits)
    assert abs(handle.routing_skew() - skew) <= 0.25
    handle.count_experts(False)
    assert handle.routing_skew() is None


@given(experts=st.integers(2, 64), tokens=st.integers(1, 4096), data=st.data())
@settings(max_examples=40, deadline=None)
def test_a_skewed_popularity_reaches_fewer_experts_than_uniform_routing_and_the_same_at_one_token(
        experts, tokens, data):
    """The cost model's expected share of experts reached: under uniform popularity the closed form;
    skewed, never more (popular experts are reached again instead of new ones), and at one token top_k
    of them either way."""
    import dataclasses

    from weightstream.placement.cost import ModelCost
    from weightstream.placement.experts import zipf_popularity

    top_k = data.draw(st.integers(1, experts - 1))
    base = ModelCost(fixed_bytes=0, head_bytes=0, block_bytes=(experts * 10,), routed_bytes=(experts * 10,),
                     experts=experts, top_k=top_k)
    uniform = dataclasses.replace(base, popularity=zipf_popularity(experts, top_k, 0.0))
    s = data.draw(st.floats(0.2, 3))
    skewed = dataclasses.replace(base, popularity=zipf_popularity(experts, top_k, s))
    closed = 1.0 - (1.0 - top_k / experts) ** tokens
    assert abs(base.reached_share(tokens) - closed) < 1e-12
    assert abs(uniform.reached_share(tokens) - closed) < 1e-9
    assert skewed.reached_share(tokens) <= closed + 1e-9
    assert abs(skewed.reached_share(1) - top_k / experts) < 1e-9


def test_by_default_the_cache_keeps_the_most_frequent_experts_which_serves_skewed_routing_best():
    """A router choosing 8 of 128 experts from a Zipf(1) popularity (Gumbel top-k), 9 slots: the
    default table (the most frequently routed experts, always) serves about what the 9 most popular
    experts take; switching to the most recently routed after 16 calls holds mostly the previous
    token's experts and serves far less (an H100 measured 0.324 with it)."""
    from weightstream.placement.experts import zipf_popularity

    experts, top_k, slots = 128, 8, 9
    logits = -torch.log(torch.arange(1, experts + 1, dtype=torch.float64))
    gen = torch.Generator().manual_seed(1)
    noise = -torch.log(-torch.log(torch.rand(1600, experts, generator=gen, dtype=torch.float64)))
    routing = torch.topk(logits + noise, top_k).indices

    def served(table: CacheTable) -> float:
        for i, idx in enumerate(routing):
            if i == 400:  # after a warm-up
                table.counts.zero_()
            table.step(table.routed(idx[None]), 1)
        counts = table.counts.tolist()
        return counts[3] / counts[2]

    best = sum(zipf_popularity(experts, top_k, 1.0)[:slots])
    frequent = served(CacheTable(experts, slots, torch.device("cpu")))
    recent = served(CacheTable(experts, slots, torch.device("cpu"), fill_calls=16))
    assert best - 0.03 < frequent and recent < frequent - 0.08


def test_eager_forwards_on_a_gpu_warn_once_that_the_cache_costs_more_than_it_saves_unless_captured():
    """The count behind the warning (the GPU test drives it through real forwards): on a GPU the
    first cached layer's hook reports each eager forward and whether a CUDA graph capture is running;
    on the CPU backend nothing is watched."""
    from weightstream.engine.expert_cache import EAGER_WARN_CALLS

    model, inputs = ZOO["qwen3_moe"]()
    handle, _ = cached_offload(model.eval().requires_grad_(False), slots=2)
    caches = handle.expert_caches
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(EAGER_WARN_CALLS + 2):
            call(model, dict(inputs, input_ids=inputs["input_ids"][:, :1]))
        assert not caches.watch_eager and caches.eager_calls == 0  # the CPU backend: nothing to warn of
        caches.watch_eager = True  # as on a GPU
        for _ in range(EAGER_WARN_CALLS - 1):
            caches.note_eager_call(capturing=False)
    assert not any("forwards eagerly" in str(w.message) for w in seen)
    says = rf"ran {EAGER_WARN_CALLS} forwards eagerly.*expert_cache=False.*--routing-skew"
    with pytest.warns(UserWarning, match=says):
        caches.note_eager_call(capturing=False)
    assert not caches.watch_eager  # once per model
    caches.watch_eager, caches.eager_calls = True, 0
    caches.note_eager_call(capturing=True)  # a capture: its replays skip Python, so no warning ever
    assert not caches.watch_eager
    handle.restore()
