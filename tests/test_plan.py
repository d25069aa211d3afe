import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightstream.errors import BudgetError
from weightstream.plan import plan_placement, spread

blocks_st = st.lists(st.integers(min_value=1, max_value=10**6), min_size=1, max_size=24)


@given(fixed=st.integers(0, 10**6), blocks=blocks_st, budget=st.integers(0, 3 * 10**7))
def test_placement_respects_budget_and_places_each_block_once(fixed, blocks, budget):
    try:
        p = plan_placement(fixed, blocks, budget)
    except BudgetError:
        assert budget < fixed + max(blocks)  # only fails below the stated minimum
        return
    assert p.gpu_bytes <= budget
    assert len(set(p.streamed)) == len(p.streamed) and all(0 <= i < len(blocks) for i in p.streamed)
    resident = [b for i, b in enumerate(blocks) if i not in p.streamed]
    assert p.resident_bytes == fixed + sum(resident)
    assert p.resident_bytes + p.streamed_bytes == fixed + sum(blocks)
    if p.streamed:
        assert p.slot_bytes == max(blocks[i] for i in p.streamed)
        assert 1 <= p.n_slots <= min(2, len(p.streamed))
    else:
        assert p.n_slots == 0


@given(fixed=st.integers(0, 10**6), blocks=blocks_st, budget=st.integers(0, 3 * 10**7),
       extra=st.integers(0, 10**7))
def test_more_budget_never_streams_more(fixed, blocks, budget, extra):
    try:
        small = plan_placement(fixed, blocks, budget)
    except BudgetError:
        return
    large = plan_placement(fixed, blocks, budget + extra)
    assert large.streamed_bytes <= small.streamed_bytes


def test_everything_fits_means_nothing_streams():
    p = plan_placement(100, [10, 10, 10], 130)
    assert p.streamed == () and p.gpu_bytes == 130


def test_two_slots_first_with_the_fewest_streamed_blocks_spread_out():
    p = plan_placement(0, [10] * 8, 70)
    assert (p.n_slots, p.streamed) == (2, spread(8, 3)) and p.streamed == (1, 4, 6)
    p = plan_placement(0, [10] * 8, 20)
    assert (p.n_slots, len(p.streamed)) == (2, 8)
    p = plan_placement(0, [10] * 8, 19)  # one slot only when two do not fit
    assert (p.n_slots, len(p.streamed)) == (1, 8)


def test_budget_error_names_the_minimum():
    with pytest.raises(BudgetError, match="at least .*1100 bytes"):
        plan_placement(1000, [100, 100], 1099)
    assert plan_placement(1000, [100, 100], 1100).n_slots == 1


@given(n=st.integers(1, 64), data=st.data())
def test_spread_gives_k_distinct_indices(n, data):
    k = data.draw(st.integers(0, n))
    picked = spread(n, k)
    assert len(picked) == k and all(0 <= i < n for i in picked)
