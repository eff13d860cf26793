"""Arrival traces for `kvserve plan --simulate`: a JSONL file, one request a line
({"t": seconds since start, "prompt_tokens": N, "output_tokens": M}), or a seeded
synthetic bursty one, `bursty:rate=2,burst_rate=20,burst_every=120,burst_len=20,...`.

Bursty because that is what LLM traffic looks like and what autoscalers get wrong: a
steady Poisson stream at `rate` requests/s with, every `burst_every` seconds, `burst_len`
seconds at `burst_rate`. Lengths are drawn log-normally around `prompt` and `output`.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

from kvserve.planner.sim_limits import MAX_LINE_CHARS, MAX_REQUESTS


@dataclass(frozen=True)
class Arrival:
    t: float
    prompt_tokens: int
    output_tokens: int


BURSTY_DEFAULTS = {
    "duration": 600.0, "rate": 1.0, "burst_rate": 10.0, "burst_every": 120.0, "burst_len": 20.0,
    "prompt": 512.0, "output": 128.0, "seed": 0.0,
}  # fmt: skip


def bursty(spec: str) -> list[Arrival]:
    """'bursty' or 'bursty:key=value,...' (keys: BURSTY_DEFAULTS)."""
    opts = dict(BURSTY_DEFAULTS)
    _, _, rest = spec.partition(":")
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in opts:
            raise ValueError(f"--simulate: {item!r}: expected key=value with a key of {', '.join(opts)}")
        try:
            opts[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--simulate: {key}={value!r} is not a number") from None
    bad = [k for k, v in opts.items() if not math.isfinite(v)]  # inf/nan: the loop never ended
    if bad:
        raise ValueError(f"--simulate: {', '.join(bad)}: must be finite")
    if opts["duration"] <= 0 or opts["rate"] < 0 or opts["burst_rate"] < 0 or opts["burst_every"] <= 0:
        raise ValueError("--simulate: duration and burst_every must be > 0, rates >= 0")
    if opts["prompt"] < 1 or opts["output"] < 1 or opts["burst_len"] < 0:
        raise ValueError("--simulate: prompt and output must be >= 1 (tokens), burst_len >= 0")
    rng = random.Random(int(opts["seed"]))
    out, t = [], 0.0
    peak = max(opts["rate"], opts["burst_rate"], 1e-9)
    if opts["duration"] * peak > MAX_REQUESTS:  # the loop draws that many arrivals before thinning
        raise ValueError(
            f"--simulate: duration x the peak rate is {opts['duration'] * peak:,.0f} arrivals; "
            f"at most {MAX_REQUESTS:,} are simulated"
        )
    while True:  # thinning: a Poisson process at the peak rate, kept with probability rate(t) / peak
        t += rng.expovariate(peak)
        if t >= opts["duration"]:
            return out
        in_burst = (t % opts["burst_every"]) < opts["burst_len"]
        if rng.random() * peak < (opts["burst_rate"] if in_burst else opts["rate"]):
            p = max(1, round(rng.lognormvariate(math.log(opts["prompt"]), 0.5)))
            o = max(1, round(rng.lognormvariate(math.log(opts["output"]), 0.5)))
            out.append(Arrival(t, p, o))


def _number(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError(f"t: {v!r} is not a number")
    return float(v)


def _count(row: dict, key: str) -> int:
    """A token count as written: 10.5, true or "10" are refused, not read as 10, 1 and 10."""
    v = row[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{key}: {v!r} is not a whole number")
    return v


def load_trace(source: str) -> list[Arrival]:
    """A bursty spec or a JSONL path; errors name the line."""
    if source == "bursty" or source.startswith("bursty:"):
        return bursty(source)
    out = []
    try:
        with open(source) as f:
            for n, line in enumerate(iter(lambda: f.readline(MAX_LINE_CHARS + 1), ""), 1):
                if len(line) > MAX_LINE_CHARS and not line.endswith("\n"):  # not read whole: no newline
                    raise ValueError(f"{source}:{n}: line longer than {MAX_LINE_CHARS} characters")
                if not line.strip():
                    continue
                if len(out) == MAX_REQUESTS:
                    raise ValueError(
                        f"{source}: more than {MAX_REQUESTS:,} requests; at most that many are simulated"
                    )
                try:
                    row = json.loads(line)
                    a = Arrival(_number(row["t"]), _count(row, "prompt_tokens"), _count(row, "output_tokens"))
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(
                        f'{source}:{n}: expected {{"t", "prompt_tokens", "output_tokens"}} ({e})'
                    ) from None
                if not a.t >= 0 or math.isinf(a.t) or a.prompt_tokens < 1 or a.output_tokens < 1:
                    raise ValueError(f"{source}:{n}: t must be finite and >= 0, token counts >= 1")
                out.append(a)
    except UnicodeDecodeError:
        raise ValueError(f"{source}: not UTF-8 text") from None
    except OSError as e:
        raise ValueError(f"{source}: {e.strerror}") from None
    if not out:
        raise ValueError(f"{source}: no requests")
    return sorted(out, key=lambda a: a.t)
