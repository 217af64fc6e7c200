import time

import pytest

from deploykit.units import format_duration, format_size, parse_duration, parse_size


@pytest.mark.parametrize("text,expected", [
    ("2GiB", 2 * 2**30), ("500MB", 500 * 10**6), ("1.5KiB", 1536), ("1TiB", 2**40), ("3GB", 3 * 10**9),
    ("10kb", 10_000), ("100 MiB", 100 * 2**20), ("7B", 7), ("1024", 1024), (4096, 4096), ("0", 0),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["2XB", "GiB", "-1GiB", "1.5", True, None, 1.5, -3, "2 G i B", ""])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_format_size_round_trips_binary_units():
    assert format_size(3) == "3 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(2 * 2**30) == "2 GiB"
    assert format_size(2**40 * 3) == "3 TiB"


@pytest.mark.parametrize("text,expected", [("120s", 120), ("2m", 120), ("500ms", 0.5), ("1h", 3600),
                                           (30, 30), ("45", 45)])
def test_parse_duration(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("bad", ["0s", "-1s", "2d", "soon", True, 0])
def test_parse_duration_rejects(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_format_duration():
    assert format_duration(0.5) == "500ms"
    assert format_duration(120) == "2m"
    assert format_duration(30) == "30s"


@pytest.mark.parametrize("parse, text", [
    (parse_size, "1" + " " * 2**20 + "#"), (parse_duration, "1" + " " * 2**20 + "#"),
    (parse_size, " " * 2**20 + "1GiB"), (parse_size, "1" * 2**20),
])
def test_long_text_is_refused_before_any_regex_runs(parse, text):
    started = time.perf_counter()
    with pytest.raises(ValueError, match="at most 64 characters"):
        parse(text)
    assert time.perf_counter() - started < 0.5  # the quadratic pattern took 110 s for 200,000 spaces


def test_whitespace_around_and_between_number_and_unit_is_still_read():
    assert parse_size(" 2GiB\n") == 2 * 2**30 and parse_size("1\t MiB") == 2**20
    assert parse_duration(" 1\t s ") == 1.0
    with pytest.raises(ValueError, match="cannot read"):
        parse_size("1" + " " * 60 + "#")
