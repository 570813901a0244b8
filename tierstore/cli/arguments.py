"""What every command shares: the error a command reports in one line, argparse's types, and
whether to show progress bars."""

from __future__ import annotations

import argparse

import torch

from ..metadata import DTYPES

EXIT_PROBLEMS, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class CommandError(Exception):
    """Bad input found by a command: printed as one line, exit code 2."""


def positive_int(text: str) -> int:
    """An argparse type: a whole number above 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def dtype_choice(text: str) -> torch.dtype:
    """An argparse type: a store's dtype by name ("float16", as ``metadata.DTYPES`` names them)."""
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[text]


def progress_of(args) -> bool | None:
    return False if args.quiet else None
