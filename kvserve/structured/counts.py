"""A count and its noun as a sentence says them: "1 value", "2,000 values" (the caps' messages
read "hold 1 values" where one const was too large)."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` with thousands separators and the noun singular for 1, else plural (noun + "s")."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
