"""Parsers of flag values, shared by every ``loom`` command's flags: each takes the text
of a flag and returns its value, or raises ``argparse.ArgumentTypeError`` with a line
that says what was expected (argparse puts the flag's name in front of it)."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """A positive integer, as vLLM's ``human_readable_int`` reads it: lower-case suffixes
    are decimal (``32k`` = 32,000, ``25.6k`` = 25,600), upper-case binary (``32K`` =
    32,768, whole numbers only)."""
    text = text.strip()
    match = _HUMAN_INT.fullmatch(text)
    if match:
        number, suffix = match.groups()
        if suffix in _DECIMAL_SUFFIXES:
            value = int(float(number) * _DECIMAL_SUFFIXES[suffix])
        elif "." in number:
            raise argparse.ArgumentTypeError(
                f"decimals are not allowed with binary suffixes like {suffix}; did you mean "
                f"{number}{suffix.lower()}? got {text}")
        else:
            value = int(number) * _BINARY_SUFFIXES[suffix]
    else:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer like 4096, 32k (32000) or 32K (32768), got {text}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return value


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0..65535, got {text}")
    return value


def port_not_zero(text: str) -> int:
    value = port(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be a port number 1..65535 (other hosts dial it)")
    return value


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"must be a JSON object: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def byte_size(text: str) -> int:
    """``512MiB``, ``2GiB``, ``1.5GB`` or a plain number of bytes."""
    number = text.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = text[len(number):].lower()
    if unit not in _UNITS or not number:
        raise argparse.ArgumentTypeError(f"must be a size like 512MiB or 2GiB, got {text}")
    return int(float(number) * _UNITS[unit])


def comma_list(text: str) -> tuple[str, ...]:
    """``a,b, c`` -> ("a", "b", "c")."""
    items = tuple(item.strip() for item in text.split(",") if item.strip())
    if not items:
        raise argparse.ArgumentTypeError(f"must be one or more names separated by commas, got "
                                         f"{text!r}")
    return items
