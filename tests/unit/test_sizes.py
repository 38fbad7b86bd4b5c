"""parse_byte_size and format_bytes: every accepted form, and errors that name the field."""

from __future__ import annotations

import pytest

from omlx.sizes import format_bytes, parse_byte_size


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, 1),
        (1_048_576, 1_048_576),
        ("1048576", 1_048_576),
        (" 42 ", 42),
        ("512B", 512),
        ("512MB", 512 * 1000**2),
        ("512mb", 512 * 1000**2),
        ("24GB", 24 * 1000**3),
        ("24 GB", 24 * 1000**3),
        ("2TB", 2 * 1000**4),
        ("3KB", 3000),
        ("3KiB", 3 * 1024),
        ("4MiB", 4 * 1024**2),
        ("1.5GiB", 1024**3 * 3 // 2),
        ("1.5gib", 1024**3 * 3 // 2),
        ("2TiB", 2 * 1024**4),
        ("0.5KB", 500),
        ("1.0005KB", 1000),  # fractions of a byte round down
        ("48000000000GB", 48 * 10**18),  # whole numbers stay exact past float precision
    ],
)
def test_accepted_forms(value: int | str, expected: int) -> None:
    assert parse_byte_size(value) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [("10%", 100), ("100%", 1000), ("2.5%", 25), (" 50 % ", 500), (".1%", 1)],
)
def test_percent_of_total(value: str, expected: int) -> None:
    assert parse_byte_size(value, total_bytes=1000) == expected


@pytest.mark.parametrize(
    ("value", "total_bytes", "reason"),
    [
        (0, None, "at least 1 byte"),
        (-5, None, "at least 1 byte"),
        ("0", None, "at least 1 byte"),
        ("0GB", None, "at least 1 byte"),
        ("-1GB", None, "not a size"),
        ("", None, "not a size"),
        ("GB", None, "not a size"),
        ("lots", None, "not a size"),
        ("24G", None, "unknown unit"),
        ("24 GBs", None, "unknown unit"),
        ("1.5", None, "whole number"),
        ("1.5B", None, "whole number"),
        ("auto", None, "not a size"),
        ("10%", None, "needs a known total"),
        ("10%", 0, "percentage of is 0 bytes"),
        ("0%", 1000, "above 0%"),
        ("101%", 1000, "at most 100%"),
        ("-10%", 1000, "not a percentage"),
        ("ten%", 1000, "not a percentage"),
        ("0.01%", 1000, "at least 1 byte"),  # rounds to zero bytes
        (1.5, None, "expected an int or a string"),
        (True, None, "expected an int or a string"),
    ],
)
def test_bad_values_name_the_field_value_and_an_example(
    value: object, total_bytes: int | None, reason: str
) -> None:
    with pytest.raises(ValueError) as info:
        parse_byte_size(value, total_bytes=total_bytes, field="max_process_memory")  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith("max_process_memory: ")
    assert repr(value) in message
    assert reason in message
    assert "use bytes, '24GB' or '10%'" in message


def test_default_field_name() -> None:
    with pytest.raises(ValueError, match=r"^size: invalid size 'x'"):
        parse_byte_size("x")


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (999, "999 B"),
        (1000, "1 KB"),
        (1536, "1.5 KB"),
        (1_500_000_000, "1.5 GB"),
        (24 * 1000**3, "24 GB"),
        (999_999, "1 MB"),  # rounds up into the next unit, never "1000 KB"
        (2 * 1000**4, "2 TB"),
        (5000 * 1000**4, "5000 TB"),
        (-1_500_000, "-1.5 MB"),
    ],
)
def test_format_bytes(num_bytes: int, text: str) -> None:
    assert format_bytes(num_bytes) == text


def test_format_then_parse_round_trips() -> None:
    assert parse_byte_size(format_bytes(24 * 1000**3)) == 24 * 1000**3
