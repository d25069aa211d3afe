"""The expert cache's Triton row copy (`engine/expert_gather.py`) run by Triton's interpreter on the CPU,
against the torch reference. Run only in a Python started with TRITON_INTERPRET=1
(tests/engine/test_expert_cache.py does)."""

from __future__ import annotations

import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightstream.engine.expert_cache import copy_rows_reference

assert os.environ.get("TRITON_INTERPRET") == "1", "start this Python with TRITON_INTERPRET=1"
from weightstream.engine import expert_gather  # noqa: E402 - after the check: compiled kernels need a GPU


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.sampled_from([1, 2, 3, 8, 12, 4100, 16384 + 8]), st.data())
def check_random_tables(n: int, width: int, data) -> None:
    """Any table (distinct destinations, some skipped, rows from either source, rows of any width,
    several programs per row included) copies what the reference copies; other rows untouched."""
    rows0, rows1, out_rows = (data.draw(st.integers(1, 6)) for _ in range(3))
    gen = torch.Generator().manual_seed(width * 131 + n)
    src0 = torch.randint(0, 256, (rows0, width), generator=gen, dtype=torch.uint8)
    src1 = torch.randint(0, 256, (rows1, width), generator=gen, dtype=torch.uint8)
    dst_row = data.draw(st.permutations(list(range(max(n, out_rows)))))[:n]
    dst_row = torch.tensor([d if d < out_rows else -1 for d in dst_row])
    which = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    src_row = torch.tensor([data.draw(st.integers(0, (rows1 if w else rows0) - 1)) for w in which.tolist()])
    want = torch.randint(0, 256, (out_rows, width), generator=gen, dtype=torch.uint8)
    got = want.clone()
    copy_rows_reference(want, src0, src1, dst_row, src_row, which)
    expert_gather.copy_rows(got, src0, src1, dst_row, src_row, which)
    assert torch.equal(got, want)
