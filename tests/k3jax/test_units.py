"""Byte sizes in and out: `--hbm 141GB`, the converter's "5.3 MiB", the memory plan's "141.00 GB"."""

from __future__ import annotations

import pytest

from k3jax.units import format_bytes, parse_bytes


@pytest.mark.parametrize(("text", "value"), [("141GB", 141 * 10**9), ("95 GiB", 95 * 2**30), ("512", 512),
                                             ("1.5tb", 1.5e12), ("2 KiB", 2048), ("3mb", 3 * 10**6)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "GB", "12XB", "1e9", "-5GB"])
def test_parse_bytes_rejects_what_it_cannot_read(text):
    with pytest.raises(ValueError, match="cannot read a byte size"):
        parse_bytes(text)


@pytest.mark.parametrize(("n", "shown"), [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"),
                                          (5_557_452, "5.3 MiB"), (3 * 2**40, "3.0 TiB"), (2**50, "1024.0 TiB")])
def test_format_bytes_in_binary_units(n, shown):
    assert format_bytes(n) == shown


def test_format_bytes_in_a_fixed_unit():
    assert format_bytes(141e9, "GB") == "141.00 GB"
    assert format_bytes(12_345_678, "GB") == "0.01 GB"
    with pytest.raises(ValueError, match="unit='gb'"):
        format_bytes(1, "gb")
