"""How large a `kvserve plan --simulate` run may be, checked before it starts.

The simulator holds the whole trace and steps every request token by token, and the CLI
replays the trace up to 2 x --max-replicas + 2 times; without bounds a large trace file (or
/dev/zero), a huge bursty duration, one request of 10^12 tokens, a trace spanning years of
15-second autoscaler ticks, step times that make the run outlast them (--token-ms 1e300) or
--min-replicas 10^9 exhausted memory or ran for ever. The
limits sit far above a realistic capacity study (a day at 10 requests/s is 864,000 requests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.planner.trace import Arrival

MAX_REQUESTS = 1_000_000  # trace lines or bursty arrivals
MAX_LINE_CHARS = 4096  # one JSONL trace line
MAX_TOKENS = 1 << 30  # prompt + output tokens over the whole trace
MAX_TICKS = 1_000_000  # autoscaler decisions over the trace's span, and over the whole run
MAX_REPLICAS = 1024  # --min-replicas / --max-replicas


def check_replicas(min_replicas: int, max_replicas: int) -> None:
    if max(min_replicas, max_replicas) > MAX_REPLICAS:
        raise ValueError(f"--min-replicas and --max-replicas must be <= {MAX_REPLICAS}")


def check_trace(trace: list[Arrival], scale_interval_s: float) -> None:
    """ValueError naming the limit a loaded trace goes past (its length was checked on load)."""
    tokens = sum(a.prompt_tokens + a.output_tokens for a in trace)
    if tokens > MAX_TOKENS:
        raise ValueError(
            f"--simulate: the trace has {tokens:,} prompt + output tokens; "
            f"at most {MAX_TOKENS:,} are simulated"
        )
    span = max(a.t for a in trace) if trace else 0.0
    ticks = span / scale_interval_s
    if ticks > MAX_TICKS:
        raise ValueError(
            f"--simulate: the trace spans {_count(span)} s, {_count(ticks)} autoscaler decisions at "
            f"--scale-interval {scale_interval_s:g}; at most {MAX_TICKS:,} (raise --scale-interval "
            "or shorten the trace)"
        )


def runaway(left: int, total: int, now: float) -> ValueError:
    """A run that goes past MAX_TICKS autoscaler decisions: its steps are too slow for the trace.
    The trace's span was checked, but not how long the replicas take to serve it: step times
    given in the wrong unit (--token-ms 1e6, 1e300) ticked the autoscaler for ever."""
    return ValueError(
        f"--simulate: {left:,} of {total:,} requests would still be unfinished at {_count(now)} s, past "
        f"{MAX_TICKS:,} autoscaler decisions: the replicas cannot keep up (--step-overhead-ms, --token-ms "
        "and --decode-token-ms are milliseconds per step, prompt token and decoding sequence)"
    )


def _count(x: float) -> str:
    """1,000,000,000 as written; 1e+308 in short rather than as 309 digits."""
    return f"{x:,.0f}" if x < 1e15 else f"{x:.3g}"
