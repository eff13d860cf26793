"""When a key made with LiteLLM's `duration` expires. `Nmo` is N calendar months, as LiteLLM's
(the same day and time N months on; the month's last day when it is shorter): it was 30 days
(a key made on 31 January with "1mo" died on 2 March, not 28 February), and `2mo` was refused,
which LiteLLM takes. Other durations are their seconds (config.parse_duration)."""

from __future__ import annotations

import calendar
import re
from datetime import UTC, datetime

from kvserve.gateway.config import parse_duration

_MONTHS = re.compile(r"\s*(\d+)\s*mo\s*")
_MAX_MONTHS = 12 * 1000  # (a year past 9999 has no datetime)


def expires_at(duration: str, now: float) -> float:
    """Unix seconds; ValueError (its message for the caller) when `duration` is no duration."""
    m = _MONTHS.fullmatch(duration)
    if m is None:
        return now + parse_duration(duration)
    n = int(m.group(1))
    if not 1 <= n <= _MAX_MONTHS:
        raise ValueError(f"{duration!r}: from 1mo to {_MAX_MONTHS}mo")
    t = datetime.fromtimestamp(now, UTC)
    year, month = divmod(t.month - 1 + n, 12)
    year += t.year
    day = min(t.day, calendar.monthrange(year, month + 1)[1])
    return t.replace(year=year, month=month + 1, day=day).timestamp()
