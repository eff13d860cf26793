"""Shares given on the command line ("30%" or "0.3"), checked at parse so the error names the flag
and its range: the plan's own checks named every field of a kind ("gpu_memory_utilization and
utilization must be in (0, 1]") whichever one was wrong."""

from __future__ import annotations

import argparse


def fraction(text: str) -> float:
    """Accept "30%" or "0.3"."""
    text = text.strip()
    return float(text[:-1]) / 100 if text.endswith("%") else float(text)


def _share_in(low: float, high: float, low_in: bool, high_in: bool):
    """A parser of shares in the range: (low, high) with each end in it or not."""
    shown = f"{'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"

    def parse(text: str) -> float:
        try:
            value = fraction(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a share such as 0.3 or 30%, got {text!r}") from None
        above = value >= low if low_in else value > low
        below = value <= high if high_in else value < high
        if not (above and below):  # NaN fails both
            raise argparse.ArgumentTypeError(f"must be in {shown}, got {text!r}")
        return value

    return parse


USED_SHARE = _share_in(0, 1, low_in=False, high_in=True)  # some of it, up to all
HELD_SHARE = _share_in(0, 1, low_in=True, high_in=False)  # none of it, up to not all
SHARE = _share_in(0, 1, low_in=True, high_in=True)
