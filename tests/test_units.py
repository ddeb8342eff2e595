"""Byte sizes as the engine options take them (sparsekv/units.py): binary multiples, a bad size a usage error."""
from __future__ import annotations

import argparse

import pytest

from sparsekv.units import parse_bytes


@pytest.mark.parametrize("text, size", [
    ("4096", 4096), ("64K", 64 * 1024), ("8M", 8 * 1024 ** 2), ("2G", 2 * 1024 ** 3), ("1T", 1024 ** 4),
    ("1.5G", 3 * 1024 ** 3 // 2), ("64KiB", 64 * 1024), ("64kb", 64 * 1024), (" 8m ", 8 * 1024 ** 2), ("10B", 10),
])
def test_sizes_are_binary_multiples(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["", "G", "lots", "inf", "nan", "1X"])
def test_a_bad_size_is_an_argparse_usage_error(text):
    with pytest.raises(argparse.ArgumentTypeError, match="not a byte size"):
        parse_bytes(text)
