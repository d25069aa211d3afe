"""Phase names of `weightstream bench`."""

import pytest

from weightstream.bench.phases import PHASE_KINDS, Phase, parse_phase


def test_phases_parse():
    assert parse_phase("decode-b64") == Phase("decode-b64", 64, 1)
    assert parse_phase("prefill-2048").tokens == 2048
    assert parse_phase("decode-b64").kind == "decode" and parse_phase("prefill-8").kind == "prefill"
    with pytest.raises(ValueError, match="decode-bN"):
        parse_phase("decode")


BAD = ["decode-b0", "prefill-0", "prefill-x", "decode-b2x", "denoise-b0", "denoise-x"]


@pytest.mark.parametrize("name", BAD)
def test_a_bad_phase_names_every_known_kind(name):
    with pytest.raises(ValueError) as err:
        parse_phase(name)
    assert all(kind.syntax in str(err.value) for kind in PHASE_KINDS)
