import pytest

from weightstream.sizes import format_size, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [(1234, 1234), ("6GiB", 6 * 2**30), ("500MB", 500 * 10**6), ("1.5GB", 1_500_000_000),
     ("  12 kib ", 12 * 1024), ("7", 7), ("2TiB", 2 * 2**40)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["6 GiBs", "", "GB", "-1GB", -5, 1.5, None, True, "1e9"])
def test_parse_size_rejects_bad_input_with_a_hint(bad):
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


def test_format_size():
    assert format_size(512) == "512 B"
    assert format_size(3 * 2**30 // 2) == "1.50 GiB"


@pytest.mark.parametrize("fraction", ["0.25", "0.5B", "1.5 b"])
def test_a_fraction_of_a_byte_is_refused_not_read_as_zero(fraction):
    """"0.25" (meant as a share of the weights) once read as 0 bytes, and the budget error spoke of
    0 B: a bare number or bytes with a fractional part is refused, saying what to give."""
    with pytest.raises(ValueError, match="bytes come whole.*'6GiB'"):
        parse_size(fraction)
