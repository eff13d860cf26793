"""argparse `type=` checks shared by the subcommands: a bad value stops the command while its
arguments are parsed (exit 2, `error: argument --flag: ...`), before a model loads or a run
starts, instead of a traceback, a silent default or a nonsense result later."""

from __future__ import annotations

import argparse
import codecs
import math
import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T", int, float)


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An integer of at least `minimum`, whose error names that bound."""

    def check(text: str) -> int:
        value = _integer(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return check


positive_int = int_at_least(1)


# vLLM's suffixes for token counts: lower case decimal, upper case binary
_TOKEN_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def token_count(text: str) -> int:
    """A positive number of tokens, written as vLLM takes it: 4096, 4k (4,000), 4K (4,096),
    25.6k (25,600; a fraction with a decimal suffix only). `--max-model-len 4k`, pasted from a
    vLLM script, was "invalid int value"."""
    from decimal import Decimal, InvalidOperation

    number, suffix = text.strip(), ""
    if number[-1:] in _TOKEN_SUFFIXES:
        number, suffix = number[:-1], number[-1]
    try:  # a fraction only before k, m, g: 25.6k is 25,600; 4.5K no number of tokens
        value = Decimal(number) if suffix.islower() else Decimal(int(number))
        value *= _TOKEN_SUFFIXES.get(suffix, 1)
    except (InvalidOperation, ValueError):
        raise argparse.ArgumentTypeError(
            f"must be a number of tokens (4096, 4k = 4,000, 4K = 4,096), got {text!r}"
        ) from None
    if not value.is_finite() or value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"must be a whole number of tokens, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {int(value)}")
    return int(value)


def max_model_len(text: str) -> int | None:
    """`token_count`, or vLLM's -1 / auto: None, the model's own context length (the default)."""
    return None if text.strip().lower() in ("-1", "auto") else token_count(text)


def port(text: str) -> int:
    """A TCP port, 0-65535: uvicorn took --port 70000 and listened on 4464 (70000 mod 65536)
    while the log said 70000."""
    value = _integer(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in 0-65535, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def json_object(text: str) -> dict:
    """A JSON object given on the command line (parsed now, so a typo names its flag)."""
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
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


def positive_float(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value:g}")
    return value


def model_name(text: str) -> str:
    """A name clients send as `model` and see in /v1/models and every answer: an empty or blank
    one was taken as it came."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must be a non-empty name, got {text!r}")
    return text


def rate(text: str) -> float:
    """Events per second: a positive number, or inf (all at once). NaN is refused: as a rate
    it sent everything at once and wrote NaN, which is not JSON, into the result file."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number or inf, got {text!r}") from None
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text!r}")
    return value


def readable_file(text: str) -> str:
    """An existing regular file (a directory fails here, not in open() after the model loads).
    A pipe or device (/dev/null, a shell's <(...)) was said to be no such file; it is refused
    for what it is: its readers read a file more than once (a validating pass, then the run)."""
    if not os.path.isfile(text):
        what = (
            "is a directory" if os.path.isdir(text)
            else "not a regular file (a pipe or a device cannot be read twice; save it to a file)"
            if os.path.exists(text) else "no such file"
        )  # fmt: skip
        raise argparse.ArgumentTypeError(f"{text!r}: {what}")
    return text


def utf8_text_file(text: str) -> str:
    """A readable file that decodes as UTF-8: checked before the model loads, so a bad file
    is one line naming the flag and where the bad byte is, not a bare codec error after it."""
    readable_file(text)
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    try:
        with open(text, "rb") as f:
            while chunk := f.read(1 << 20):
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as e:  # e.object: bytes held from the last chunk + this one
                    at = offset - (len(e.object) - len(chunk)) + e.start
                    raise argparse.ArgumentTypeError(
                        f"{text!r}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {at})"
                    ) from None
                offset += len(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise argparse.ArgumentTypeError(f"{text!r}: not UTF-8 text (it ends inside a character)") from None
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e.strerror or e}") from None
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


def at_most(parse: Callable[[str], T], limit: float, why: str) -> Callable[[str], T]:
    """`parse`'s value, at most `limit`; `why` says what the bound stands for. Past any real use
    a value is a typo (1e300 for 1e3), and it came back as an answer of hundreds of digits."""

    def check(text: str) -> T:
        value = parse(text)
        if value > limit:
            shown = f"{value:g}" if isinstance(value, float) else value
            raise argparse.ArgumentTypeError(f"must be <= {limit:,.0f} ({why}), got {shown}")
        return value

    return check
