"""The cost model against hand-computed schedules."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightstream.placement.cost import ModelCost, largest, predict
from weightstream.placement.probe import MachineProfile

# 1 byte/s copies; resident GEMMs 0.1 s/byte; zero copy 2 s/byte: easy arithmetic
PROFILE = MachineProfile("test", copy_s_per_byte=1.0, resident={1: 0.1, 2048: 0.1}, uva={1: 2.0, 2048: 2.0})
MODEL = ModelCost(fixed_bytes=0, head_bytes=0, block_bytes=(10, 10, 10, 10))


def test_all_resident_is_the_sum_of_compute():
    p = predict(MODEL, (), 0, (), 1, PROFILE)
    assert p.ms == pytest.approx(4 * 1.0 * 1e3) and p.bound == "compute" and p.link_ms == 0


def test_streaming_everything_through_two_slots_is_link_bound():
    # copies of 10 s back to back; each block computes 1 s after its copy lands; the last lands at 40
    p = predict(MODEL, (0, 1, 2, 3), 2, (), 1, PROFILE)
    assert p.ms == pytest.approx(41 * 1e3) and p.bound == "link" and p.link_ms == pytest.approx(40e3)


def test_one_slot_serializes_copy_and_compute():
    # copy 10, compute 1, then the next copy starts: 4 x 11
    assert predict(MODEL, (0, 1, 2, 3), 1, (), 1, PROFILE).ms == pytest.approx(44e3)


def test_resident_blocks_between_streamed_ones_hide_copies():
    # stream blocks 1 and 3 with one slot: prologue copy of 1 starts after block 0 (t=1), lands at 11;
    # block 1 computes to 12, releases, copy of 3 lands at 22; block 2 computes 12..13; block 3: 22..23
    assert predict(MODEL, (1, 3), 1, (), 1, PROFILE).ms == pytest.approx(23e3)


def test_zero_copy_blocks_read_over_the_link():
    assert predict(MODEL, (), 0, (0, 1), 1, PROFILE).ms == pytest.approx((2 * 20 + 2 * 1) * 1e3)


def test_interpolation_between_measured_token_counts():
    profile = MachineProfile("t", 1.0, resident={1: 1.0, 100: 2.0}, uva={1: 1.0, 100: 1.0})
    assert profile.resident_seconds(1, 10) == pytest.approx(1.5)  # halfway in log(tokens)
    assert profile.resident_seconds(1, 400) == pytest.approx(8.0)  # beyond: grows with tokens


def test_time_outside_the_gemms_is_added_to_every_block_by_width():
    profile = MachineProfile("t", 1.0, resident={1: 0.1}, uva={1: 2.0}, block_extra={1: 0.5})
    wide = ModelCost(fixed_bytes=0, head_bytes=0, block_bytes=(10, 10, 10, 10), width=2)
    # resident: 4 x (1 s of GEMM + 2 x 0.5 s); without a width, GEMM time only
    assert predict(wide, (), 0, (), 1, profile).ms == pytest.approx(8e3)
    assert predict(MODEL, (), 0, (), 1, profile).ms == pytest.approx(4e3)
    # zero copy: the read (20 s) then the block's other kernels (1 s), per block
    assert predict(wide, (), 0, (0,), 1, profile).ms == pytest.approx((20 + 1) * 1e3 + 3 * 2e3)
    # streamed through 2 slots: copies of 10 s still bound it; the last block ends 2 s after its copy
    assert predict(wide, (0, 1, 2, 3), 2, (), 1, profile).ms == pytest.approx(42e3)


def test_largest_picks_the_biggest_tensors_in_position_order():
    assert largest((256, 2048, 256, 4096), 2) == (1, 3)
    assert largest((5, 5, 1), 1) == (0,)  # ties: the earlier one
    assert largest((1, 2), 0) == largest((1, 2), 5) == (0, 1)  # 0 or too many: the whole block


def test_a_block_streaming_part_of_itself_copies_only_that_part():
    model = ModelCost(fixed_bytes=0, head_bytes=0, block_bytes=(10, 10), tensor_bytes=((2, 8), (2, 8)))
    assert model.streamed_bytes(0, 1) == 8 and model.streamed_bytes(0) == 10
    assert model.staging(0, 1) == 8 and model.staging(0) == 10
    # two slots, copies of 8 s: the second lands at 16; each block still computes all its 10 bytes (1 s)
    assert predict(model, (0, 1), 2, (), 1, PROFILE, part=1).ms == pytest.approx(17e3)
    assert predict(model, (0, 1), 2, (), 1, PROFILE).ms == pytest.approx(21e3)


def test_routed_experts_are_read_in_the_share_any_token_reaches():
    # blocks of 2 dense bytes and 8 bytes in 4 experts, 2 per token: one token reaches half the experts,
    # two tokens 1 - (1/2)^2 = 3/4 of them (each at 2 * 2 / (4 * 3/4) = 4/3 tokens), many tokens all
    moe = ModelCost(fixed_bytes=0, head_bytes=0, block_bytes=(10, 10), routed_bytes=(8, 8), experts=4,
                    top_k=2)
    assert moe.reads(0, 1) == ((2, 1), (4.0, 1.0))
    assert moe.reads(0, 2) == ((2, 2), (6.0, pytest.approx(4 / 3)))
    assert moe.reads(0, 2048)[1][0] == pytest.approx(8.0)
    assert MODEL.reads(0, 1) == ((10, 1),)  # dense: every byte at every token
    # zero copy reads 6 bytes per block over the link (2 s/byte); resident GEMMs 0.6 s per block
    assert predict(moe, (), 0, (0, 1), 1, PROFILE).ms == pytest.approx(2 * 6 * 2.0 * 1e3)
    assert predict(moe, (), 0, (), 1, PROFILE).ms == pytest.approx(2 * 0.6 * 1e3)
    # a copy moves every expert (the router has not run): 10 s per block, whatever the tokens
    assert predict(moe, (0, 1), 2, (), 1, PROFILE).ms == pytest.approx(20e3 + 0.6e3)


def test_quantized_weights_cost_their_dequantizing_gemm():
    """A block of 10 fp8 bytes (20 bf16-equivalent bytes): streaming moves 10 bytes, computing costs the
    bf16 GEMM of 20 bytes times the dequantize ratio."""
    profile = MachineProfile("q", copy_s_per_byte=1.0, resident={1: 0.1, 2048: 0.1}, uva={1: 2.0, 2048: 2.0},
                             dequant={1: 3.0, 2048: 1.5})
    quant = ModelCost(0, 0, (10, 10), quant_bytes=(10, 10), quant_bf16_bytes=(20, 20))
    assert predict(quant, (), 0, (), 1, profile).ms == pytest.approx(2 * 20 * 0.1 * 3.0 * 1e3)
    assert predict(quant, (), 0, (), 2048, profile).ms == pytest.approx(2 * 20 * 0.1 * 1.5 * 1e3)
    # streamed: copies of the 10 stored bytes, back to back, then the last block's 6 s of compute
    assert predict(quant, (0, 1), 2, (), 1, profile).ms == pytest.approx((20 + 6) * 1e3)


def test_a_partly_quantized_block_splits_its_bytes():
    profile = MachineProfile("q", 1.0, resident={1: 0.1}, uva={1: 2.0}, dequant={1: 2.0})
    mixed = ModelCost(0, 0, (10,), quant_bytes=(4,), quant_bf16_bytes=(8,))
    assert predict(mixed, (), 0, (), 1, profile).ms == pytest.approx((6 * 0.1 + 8 * 0.1 * 2.0) * 1e3)


# --- compressed groups: blobs land ahead, decodes take turns with compute ---------------------------

def _coded(blocks: int, raw: int, wire: int) -> ModelCost:
    """`blocks` blocks of one tensor of `raw` bytes, each `wire` bytes on the wire (plus the 64-byte
    header `wire_bytes` adds)."""
    return ModelCost(0, 0, (raw,) * blocks, tensor_bytes=((raw,),) * blocks,
                     tensor_wire=((wire - 64,),) * blocks)


CODED = MachineProfile("coded", copy_s_per_byte=0.01, resident={1: 0.001, 2048: 0.001},
                       uva={1: 1.0, 2048: 1.0}, decode_s_per_byte=0.002)


def test_compressed_two_slots_land_ahead_and_decode_when_compute_reaches_the_group():
    # wire copies 5 s, decodes 2 s, compute 1 s per block. Prologue lands 0 (0..5) and 1 (5..10).
    # Block 0: decode 5..7, compute ..8. Block 1: decode 10..12, compute ..13. Blob 2 was issued in
    # the prologue and waits for buffer 0's decode (7): lands 10..15; decode 15..17, compute ..18.
    # Blob 3 lands 15..20; decode 20..22, compute ..23.
    p = predict(_coded(4, 1000, 500), (0, 1, 2, 3), 2, (), 1, CODED, compressed=True)
    assert p.ms == pytest.approx(23e3) and p.link_ms == pytest.approx(20e3)


def test_a_decode_never_overlaps_compute():
    # copies 1 s, decodes 2 s, compute 10 s per block: compute-bound, and every decode adds to it
    # (prologue: 1 s copy; then 4 x (2 s decode + 10 s compute))
    fast_link = MachineProfile("c", 0.002, resident={1: 0.01, 2048: 0.01}, uva={1: 1.0, 2048: 1.0},
                               decode_s_per_byte=0.002)
    p = predict(_coded(4, 1000, 500), (0, 1, 2, 3), 2, (), 1, fast_link, compressed=True)
    assert p.ms == pytest.approx((1 + 4 * 12) * 1e3)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 2000), min_size=2, max_size=9),
       streamed_mask=st.lists(st.booleans(), min_size=9, max_size=9),
       ratio=st.floats(0.1, 1.0), n_slots=st.integers(1, 2), landing=st.sampled_from([None, 1, 2]),
       copy=st.floats(1e-4, 1e-1), compute=st.floats(1e-4, 1e-1), decode=st.floats(1e-5, 1e-1))
def test_compressed_prediction_lies_between_its_bounds(sizes, streamed_mask, ratio, n_slots, landing, copy,
                                                       compute, decode):
    """Over random models, placements and rates: a compressed forward takes at least its copies and at
    least its compute plus its decodes (they take turns), and at most all three one after another."""
    streamed = tuple(b for b in range(len(sizes)) if streamed_mask[b])
    if len(streamed) < n_slots or (landing == 1 and n_slots == 2):
        return
    model = ModelCost(0, 0, tuple(sizes), tensor_bytes=tuple((s,) for s in sizes),
                      tensor_wire=tuple((max(1, int(s * ratio)) - 64,) for s in sizes))
    profile = MachineProfile("h", copy, resident={1: compute, 2048: compute}, uva={1: 1.0, 2048: 1.0},
                             decode_s_per_byte=decode)
    p = predict(model, streamed, n_slots, (), 1, profile, compressed=True, n_landing=landing)
    decode_ms = sum(profile.decode_seconds(sizes[b]) for b in streamed) * 1e3
    tol = 1e-6 * (p.link_ms + p.compute_ms + decode_ms)
    assert p.ms >= p.link_ms - tol
    assert p.ms >= p.compute_ms + decode_ms - tol
    assert p.ms <= p.link_ms + p.compute_ms + decode_ms + tol


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.lists(st.integers(1, 1 << 20), min_size=1, max_size=4), min_size=1, max_size=5),
       part=st.integers(0, 4), ratio=st.floats(0.1, 1.0), tokens=st.sampled_from([1, 64, 4096]))
def test_what_the_cost_remembers_matches_a_fresh_cost(sizes, part, ratio, tokens):
    # the planner asks a ModelCost for the same blocks thousands of times and it remembers the answers:
    # they must be what a fresh cost computes, a copy with other fields must not see the old answers,
    # and another profile must get its own block times
    def cost(r):
        return ModelCost(100, 50, tuple(map(sum, sizes)), width=64, tensor_bytes=tuple(map(tuple, sizes)),
                         tensor_wire=tuple(tuple(int(n * r) + 1 for n in t) for t in sizes))

    def answers(c, profile):
        blocks = range(len(sizes))
        return ([c.streamed_bytes(b, part) for b in blocks], [c.wire_bytes(b, part) for b in blocks],
                [c.staging(b, part) for b in blocks], c.block_seconds(tokens, profile),
                predict(c, tuple(blocks), 1, (), tokens, profile, part, True, 2))

    slow = dataclasses.replace(PROFILE, resident={m: 2 * v for m, v in PROFILE.resident.items()})
    used = cost(ratio)
    first = answers(used, PROFILE)
    assert answers(used, PROFILE) == first == answers(cost(ratio), PROFILE)
    other = dataclasses.replace(used, tensor_wire=cost(ratio / 2).tensor_wire)
    assert answers(other, PROFILE) == answers(cost(ratio / 2), PROFILE)
    assert answers(used, slow) == answers(cost(ratio), slow)
    assert answers(used, slow)[3] != first[3]


def test_a_forward_after_another_starts_with_its_first_groups_copied():
    # two slots, everything streamed: the next forward's groups 0 and 1 are copied once blocks 2 and 3
    # release (lands 50 and 60), so the second forward runs 50..81: 40 s, the link's time alone
    p = predict(MODEL, (0, 1, 2, 3), 2, (), 1, PROFILE)
    assert p.ms == pytest.approx(41e3) and p.warm_ms == pytest.approx(40e3)
    # one slot serializes either way: 4 x 11
    assert predict(MODEL, (0, 1, 2, 3), 1, (), 1, PROFILE).warm_ms == pytest.approx(44e3)
    # streamed blocks 1 and 3, one slot: block 3's release (23) copies block 1 for the next forward
    # (lands 33) while block 0 computes 23..24; block 1 33..34, block 3's copy 34..44, 44..45: 22 s
    p = predict(MODEL, (1, 3), 1, (), 1, PROFILE)
    assert p.ms == pytest.approx(23e3) and p.warm_ms == pytest.approx(22e3)
    assert p.calls_ms(3) == pytest.approx((23 + 2 * 22) * 1e3) and p.calls_ms(0) == 0


def test_a_group_alone_in_its_slot_stays_there():
    # groups 0 and 2 share slot 0, group 1 has slot 1 to itself: after the first forward only groups
    # 0 and 2 cross the link. Second forward: group 0 lands 41 (copied when group 2 released at 31),
    # 41..42, group 1 is staged 42..43, group 2 lands 52, 52..53, block 3 53..54: 22 s
    p = predict(MODEL, (0, 1, 2), 2, (), 1, PROFILE)
    assert p.ms == pytest.approx(32e3) and p.warm_ms == pytest.approx(22e3)


def test_compressed_groups_of_the_next_forward_land_ahead_too():
    # as above: the first forward ends at 23 (blob 3 landed at 20). The next forward's first blobs
    # are not copied ahead across forwards: blob 0 goes when block 2 releases (18) and waits for the
    # link: 20..25, decode 25..27, compute ..28; blob 1 (block 3's release, 23) 25..30, decode
    # 30..32, ..33; blob 2 30..35, ..38; blob 3 35..40, ..43: 20 s, the link's
    p = predict(_coded(4, 1000, 500), (0, 1, 2, 3), 2, (), 1, CODED, compressed=True)
    assert p.ms == pytest.approx(23e3) and p.warm_ms == pytest.approx(20e3)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 2000), min_size=2, max_size=9),
       mask=st.lists(st.booleans(), min_size=9, max_size=9), uva_mask=st.lists(st.booleans(), min_size=9,
                                                                               max_size=9),
       n_slots=st.integers(1, 2), compressed=st.booleans(), copy=st.floats(1e-4, 1e-1),
       compute=st.floats(1e-4, 1e-1), decode=st.floats(1e-5, 1e-1))
def test_a_warm_forward_is_at_least_compute_and_at_most_a_cold_one_plus_its_early_copies(
        sizes, mask, uva_mask, n_slots, compressed, copy, compute, decode):
    streamed = tuple(b for b in range(len(sizes)) if mask[b])
    uva = tuple(b for b in range(len(sizes)) if uva_mask[b] and not mask[b])
    if len(streamed) < n_slots or (not streamed and n_slots):
        n_slots = min(n_slots, len(streamed))
    model = ModelCost(0, 0, tuple(sizes), tensor_bytes=tuple((s,) for s in sizes),
                      tensor_wire=tuple((max(1, s // 2) - 64,) for s in sizes))
    profile = MachineProfile("h", copy, resident={1: compute, 2048: compute}, uva={1: 1.0, 2048: 1.0},
                             decode_s_per_byte=decode)
    p = predict(model, streamed, n_slots, uva, 1, profile, compressed=compressed and bool(streamed))
    tol = 1e-6 * (p.ms + p.link_ms)
    assert p.warm_ms >= p.compute_ms - tol
    if not uva or not streamed:  # the earlier copies only take link time no forward needs otherwise
        assert p.warm_ms <= p.ms + tol
    else:  # a zero-copy block that runs before the first streamed one waits for those copies
        lead = sum(profile.copy_seconds(model.wire_bytes(b) if compressed else sizes[b])
                   for b in streamed[:n_slots]) * 1e3
        assert p.warm_ms <= p.ms + lead + tol
    if not streamed:  # nothing is prefetched: every forward is alike
        assert p.warm_ms == p.ms


def test_the_next_forwards_first_group_starts_when_its_slot_comes_free_its_blob_before():
    # compute-bound (wire 1 s, decode 2 s, compute 10 s per block), two slots. Four groups: the next
    # forward's group 0 shares slot 0 with group 2, so it starts when group 2 releases and its blob
    # lands while group 3 computes: each further forward saves the first blob's second (49 -> 48).
    # Five groups: group 0 shares slot 0 with the last group (4), so it starts only at the very end;
    # but its blob was sent ahead into its landing buffer when group 4 started, so only its decode
    # is left, as for every group (61 -> 60). Group 1, whose slot came free earlier, waits for it
    # (the next forward's groups start, and their blobs go, in its run order).
    fast_link = MachineProfile("c", 0.002, resident={1: 0.01, 2048: 0.01}, uva={1: 1.0, 2048: 1.0},
                               decode_s_per_byte=0.002)
    even = predict(_coded(4, 1000, 500), (0, 1, 2, 3), 2, (), 1, fast_link, compressed=True)
    assert (even.ms, even.warm_ms) == pytest.approx((49e3, 48e3))
    odd = predict(_coded(5, 1000, 500), (0, 1, 2, 3, 4), 2, (), 1, fast_link, compressed=True)
    assert (odd.ms, odd.warm_ms) == pytest.approx((61e3, 60e3))


def test_a_zero_copy_block_after_the_streamed_ones_waits_for_blobs_sent_before_it():
    # blocks 0-3 streamed through two slots, block 4 zero copy (20 s), copies 10 s, compute 1 s. Raw:
    # the last two releases copy the next forward's groups 0 and 1 (31..50, 50..60 on the link), so
    # block 4's read starts at 60 and the first forward ends at 80. Compressed with blobs as large as
    # the raw groups and decodes of no time, the blobs sent before block 4 go first too: the same.
    free_decode = dataclasses.replace(PROFILE, decode_s_per_byte=1e-12)
    model = ModelCost(0, 0, (10,) * 5, tensor_bytes=((10,),) * 5, tensor_wire=((10 - 64,),) * 5)
    raw = predict(model, (0, 1, 2, 3), 2, (4,), 1, free_decode)
    coded = predict(model, (0, 1, 2, 3), 2, (4,), 1, free_decode, compressed=True)
    assert raw.ms == pytest.approx(80e3) and coded.ms == pytest.approx(80e3, rel=1e-6)
    # each further forward: 61 raw; compressed a second less, its first blob being sent ahead into a
    # landing buffer before group 0's slot is released
    assert raw.warm_ms == pytest.approx(61e3) and coded.warm_ms == pytest.approx(60e3, rel=1e-6)
