from hypothesis import given
from hypothesis import strategies as st

from weightstream.placement.layout import ALIGN, align_up, pack


@given(st.lists(st.integers(min_value=1, max_value=10**7), max_size=40))
def test_pack_is_aligned_disjoint_and_tight(sizes):
    slices, total = pack(sizes)
    assert [s.nbytes for s in slices] == sizes
    for a, b in zip(slices, slices[1:], strict=False):
        assert a.offset + a.nbytes <= b.offset < a.offset + a.nbytes + ALIGN
    assert all(s.offset % ALIGN == 0 for s in slices)
    assert total == (align_up(slices[-1].offset + slices[-1].nbytes) if sizes else 0)
    assert total < sum(sizes) + ALIGN * len(sizes) + 1
