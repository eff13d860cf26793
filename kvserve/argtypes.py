"""argparse `type=` checks shared by the subcommands: a bad value stops the command while its
arguments are parsed (exit 2, `error: argument --flag: ...`), before a model loads or a run
starts, instead of a traceback, a silent default or a nonsense result later."""

from __future__ import annotations

import argparse
import math
import os


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value:g}")
    return value


def readable_file(text: str) -> str:
    """An existing regular file (a directory fails here, not in open() after the model loads)."""
    if not os.path.isfile(text):
        what = "is a directory" if os.path.isdir(text) else "no such file"
        raise argparse.ArgumentTypeError(f"{text!r}: {what}")
    return text


def writable_file(text: str) -> str:
    """A file path that can be written: checked before the run, so its result is not lost."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r}: is a directory")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text!r}: no such directory {folder!r}")
    if not os.access(folder, os.W_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text!r}: not writable")
    return text
