"""argparse types for q35lab's command lines (``python -m q35lab``, ``python -m q35lab.e2e``): each
checks one option's value and says what it expected; argparse names the option and prints the
command's usage (exit code 2)."""

from __future__ import annotations

import argparse
import decimal
import math
import re
from pathlib import Path

#: A count of tokens as written: 524288, 524_288, 5.24e5, with k (1024) or M (1024²) after it.
_TOKENS = re.compile(r"[+-]?(\d+(_\d+)*(\.\d*)?|\.\d+)([eE][+-]?\d+)?[kKmM]?")
_TOKEN_SCALES = {"k": 1024, "m": 1024**2}


def whole_number(least: int):
    """A type: a whole number of at least ``least`` (a rank, a count of layers or steps)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"expected a whole number of at least {least}, got {text!r}")
        return value

    return parse


def tokens(least: int = 1):
    """A type: a whole number of tokens, at least ``least``, written as 524288, 524_288, 512k
    (k = 1024, as in "a 32k context"), 1M (1024²) or 1e6."""

    def parse(text: str) -> int:
        written = text.strip()
        if not _TOKENS.fullmatch(written):
            raise argparse.ArgumentTypeError(f"expected a number of tokens (e.g. 524288, 524_288, 512k, 1M or 1e6), "
                                             f"got {text!r}")
        scale = _TOKEN_SCALES.get(written[-1].lower(), 1)
        value = decimal.Decimal(written.rstrip("kKmM").replace("_", "")) * scale
        if value != value.to_integral_value():
            raise argparse.ArgumentTypeError(f"expected a whole number of tokens, got {text!r} (= {value:f})")
        if value < least:
            raise argparse.ArgumentTypeError(f"expected at least {least:,} token{'s' * (least != 1)}, got {text!r}")
        return int(value)

    return parse


def real_number(least: float, above: bool, what: str):
    """A type: a finite number of at least ``least`` (above it, when ``above``), e.g. a size in GiB."""
    expected = f"{what} (a finite number, {'above' if above else 'at least'} {least:g})"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (least < value if above else least <= value) or not value < math.inf:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


def folder(text: str) -> Path:
    """A type: a folder that exists (results to read)."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"no such folder: {text}")
    return path


def output_folder(text: str) -> Path:
    """A type: a folder to write results into (made where missing), not an existing file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a folder to write results into, got the file {text}")
    return path


def output_file(text: str) -> Path:
    """A type: a file to write (its folder made where missing), not an existing folder."""
    path = Path(text)
    if path.is_dir() or not path.name:
        raise argparse.ArgumentTypeError(f"expected a file to write, got the folder {text}")
    return path
