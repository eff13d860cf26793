"""The load generator: streams requests at an OpenAI-compatible server and timestamps every chunk.

The client must never be the bottleneck, nor take the CPU the server under test needs (on a
2-core machine it shares the cores), so the per-chunk path is small: aiohttp's C HTTP parser
hands over raw bytes, which are split on blank lines, each event is decoded with msgspec, and
only a timestamp is kept per chunk that carries text. httpx spent ~110 us of client CPU a chunk
here, aiohttp ~30 us (docs/BENCHMARKS.md, issue 16 round 36). Token counts come from the
server's final usage chunk (stream_options), or, for servers that do not send one, from the
caller's `count_tokens` over the generated text.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from kvserve.bench.datasets import BenchRequest

_ANSWERED = ("stop", "length", "tool_calls")  # finish reasons of a complete answer (not an abort)
INTERRUPTED = "interrupted (Ctrl-C) before it finished"  # the error of a request the user cut short
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


@dataclass
class LoadConfig:
    base_url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    request_rate: float = math.inf  # requests/s; inf sends them all at once
    burstiness: float = 1.0  # gamma shape: 1 is Poisson, < 1 burstier, > 1 steadier
    max_concurrency: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    prompt_format: str = "text"  # "ids" sends token ids (completions only)
    api_key: str | None = None
    timeout: float = 6 * 3600
    seed: int = 0
    extra_body: dict[str, Any] = field(default_factory=dict)
    progress: bool = True


@dataclass
class RequestResult:
    """What one request saw. Times are seconds; `start` is relative to the benchmark start."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between a choice's text-carrying chunks
    text: str = ""  # the choices' texts, one after the other
    choices: int = 1  # choices that streamed (n > 1: several per request)


def _body(cfg: LoadConfig, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model, "max_tokens": req.output_len, "temperature": cfg.temperature, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    if cfg.endpoint == "chat":
        body["messages"] = req.messages or [{"role": "user", "content": req.text}]
    else:
        body["prompt"] = req.prompt_ids if cfg.prompt_format == "ids" else req.text
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    return body


def _url(cfg: LoadConfig) -> str:
    base = cfg.base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return base + ("/chat/completions" if cfg.endpoint == "chat" else "/completions")


async def send_one(
    http: aiohttp.ClientSession,
    cfg: LoadConfig,
    req: BenchRequest,
    t_base: float,
    count_tokens: Callable[[str], int] | None = None,
) -> RequestResult:
    """Stream one request; never raises (failures come back with success=False)."""
    res = RequestResult(prompt_len=req.prompt_len)
    chat = cfg.endpoint == "chat"
    # Per choice index: with n > 1 the choices' chunks interleave, and a gap between one
    # choice's token and another's is no inter-token latency anyone sees.
    times: dict[int, list[float]] = {}
    pieces: dict[int, list[str]] = {}
    finished: float | None = None  # when a choice's finish_reason came (an answer may have no text)
    usage = None
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    t0 = time.perf_counter()
    res.start = t0 - t_base
    try:
        async with http.post(_url(cfg), data=_encode(_body(cfg, req)), headers=headers) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read())[:200].decode(errors='replace')}"
                return res
            buf, head, events_seen = b"", b"", False
            async for raw in r.content.iter_any():
                now = time.perf_counter()
                if not events_seen and len(head) < 100:
                    head += raw[:100]
                events = (buf + raw).split(b"\n\n")
                buf = events.pop()
                for ev in events:
                    ev = ev.strip()
                    if not ev.startswith(b"data:"):
                        continue  # comments / keep-alives
                    events_seen = True
                    payload = ev[5:].strip()
                    if payload == b"[DONE]":
                        continue
                    obj = _decode(payload)
                    if not _is_event(obj):  # was an AttributeError traceback that ended the run
                        res.error = f"not an OpenAI stream event: {payload[:200].decode(errors='replace')}"
                        return res
                    if "error" in obj and obj["error"]:
                        err = obj["error"]
                        res.error = str(err.get("message", err) if isinstance(err, dict) else err)
                        return res
                    for c in obj.get("choices") or ():
                        text = (c.get("delta") or {}).get("content") if chat else c.get("text")
                        if text:
                            index = c.get("index") or 0
                            times.setdefault(index, []).append(now)
                            pieces.setdefault(index, []).append(text)
                        if c.get("finish_reason") in _ANSWERED and finished is None:
                            finished = now
                    if obj.get("usage"):
                        usage = obj["usage"]
    except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    end = time.perf_counter()
    if not times and finished is None:
        res.error = "no text was streamed"
        if not events_seen:  # a web page, a JSON answer (stream ignored), ...: said as what it was
            body = head[:100].decode(errors="replace").strip()
            res.error += f" (the answer was no event stream: {r.content_type or 'no content type'}: {body!r})"
        return res
    # An answer that ended with no text (the model's end-of-sequence first, a stop string at
    # once) is an answer, as in vLLM's benchmark: its first token arrived with the finish.
    texts = ["".join(pieces[i]) for i in sorted(pieces)]
    res.text = "".join(texts)
    res.choices = max(1, len(times))
    res.ttft = (min(ts[0] for ts in times.values()) if times else finished) - t0
    res.latency = end - t0
    res.itl = [b - a for ts in times.values() for a, b in zip(ts, ts[1:])]
    if usage and usage.get("completion_tokens") is not None:  # every choice's tokens, as OpenAI's
        res.output_tokens = int(usage["completion_tokens"])
        res.prompt_len = int(usage.get("prompt_tokens") or res.prompt_len)
    elif count_tokens:
        res.output_tokens = sum(count_tokens(t) for t in texts)
    else:
        res.output_tokens = sum(len(ts) for ts in times.values())
    res.success = True
    return res


def _is_event(obj: Any) -> bool:
    """A JSON object whose `choices`, if any, is a list of objects."""
    if not isinstance(obj, dict):
        return False
    choices = obj.get("choices") or []
    return isinstance(choices, list) and all(isinstance(c, dict) for c in choices)


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each request: gamma(shape=burstiness, mean=1/rate) gaps, so the
    long-run rate is `rate` whatever the burstiness (shape 1 is a Poisson process)."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request-rate and burstiness: must be positive")
    rng = random.Random(seed)
    return [0.0] + [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n - 1)]


def schedule(requests: list[BenchRequest], cfg: LoadConfig) -> list[float]:
    """Gaps between sends: a trace's own arrival times (the first sent at once), else the
    request rate's gamma arrivals."""
    times = [r.arrival_s for r in requests]
    if requests and all(t is not None for t in times):
        return [0.0] + [max(0.0, b - a) for a, b in zip(times, times[1:])]
    return arrival_gaps(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)


def _client(n: int, timeout: float) -> aiohttp.ClientSession:
    """Up to n + 4 keep-alive connections; `timeout` bounds a connect and each wait for bytes,
    not a whole stream."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=n + 4),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout),
        headers={"Content-Type": "application/json"},
    )


async def _prime(http: aiohttp.ClientSession, cfg: LoadConfig) -> None:
    """One cheap GET before the clock starts, so the first timed request does not pay for the
    client's first-use setup (with httpx, ~0.2 s of blocked event loop charged to TTFT)."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    try:
        async with http.get(
            _url(cfg).rsplit("/", 2 if cfg.endpoint == "chat" else 1)[0] + "/models", headers=headers
        ) as r:
            await r.read()
    except (TimeoutError, aiohttp.ClientError, OSError):
        pass  # the benchmark itself will report an unreachable server


async def run_load(
    cfg: LoadConfig,
    requests: list[BenchRequest],
    count_tokens: Callable[[str], int] | None = None,
    warmup: int = 0,
) -> tuple[list[RequestResult], float]:
    """Send `warmup` untimed requests, then all `requests` on the arrival schedule under the
    concurrency cap. Returns the results in request order and the wall time of the timed part."""
    from tqdm import tqdm

    cap = cfg.max_concurrency or len(requests)
    async with _client(max(cap, warmup), cfg.timeout) as http:
        await _prime(http, cfg)
        if warmup:
            warm = [requests[i % len(requests)] for i in range(warmup)]
            results = await asyncio.gather(*(send_one(http, cfg, r, time.perf_counter()) for r in warm))
            failed = [r.error for r in results if not r.success]
            if failed:
                raise RuntimeError(f"warm-up request failed: {failed[0]}")

        sem = asyncio.Semaphore(cap)
        bar = tqdm(total=len(requests), desc="bench", unit="req", disable=not cfg.progress)

        async def limited(req: BenchRequest) -> RequestResult:
            async with sem:
                res = await send_one(http, cfg, req, t_base, count_tokens)
            bar.update(1)
            return res

        tasks = []
        t_base = due = time.perf_counter()
        try:
            for req, gap in zip(requests, schedule(requests, cfg)):
                due += gap  # absolute schedule: sleep overheads do not accumulate
                if due > time.perf_counter():
                    await asyncio.sleep(due - time.perf_counter())
                tasks.append(asyncio.create_task(limited(req)))
            results = list(await asyncio.gather(*tasks))
        except asyncio.CancelledError:  # Ctrl-C (asyncio.run cancels this task): what finished
            results = await _interrupted(tasks, requests)
        duration = time.perf_counter() - t_base
        bar.close()
    return results, duration


async def _interrupted(tasks: list[asyncio.Task], requests: list[BenchRequest]) -> list[RequestResult]:
    """The results of a run cut short: the requests that finished as they were, the others (in
    flight, waiting for a slot, not sent yet) failed with INTERRUPTED. Was a traceback that lost
    every result of what may have been a long run."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    done = [t.result() if t.done() and not t.cancelled() else None for t in tasks]
    done += [None] * (len(requests) - len(done))
    return [r or RequestResult(error=INTERRUPTED, prompt_len=q.prompt_len) for r, q in zip(done, requests)]
