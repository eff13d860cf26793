"""Benchmark workloads made of real tokenizer tokens, generated locally (nothing is downloaded).

Prompts are sequences of whole-word tokens drawn from the model's own vocabulary, so the text
re-encodes to (nearly) the same ids and every prompt is distinct — a server cannot shortcut
them with a prefix cache unless the dataset shares prefixes on purpose (`prefix`).
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass, field
from typing import Any

DATASETS = ("random", "prefix", "chat", "jsonl", "trace")


@dataclass
class BenchRequest:
    """One request: its text (or chat messages) and token ids, and how many tokens to ask for."""

    text: str
    prompt_ids: list[int]
    output_len: int
    messages: list[dict[str, str]] | None = None
    arrival_s: float | None = None  # trace: when to send it, seconds after the first

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass
class DatasetConfig:
    name: str = "random"
    num_prompts: int = 100
    input_len: int = 128  # random/prefix: tokens per prompt (after the prefix); chat: the median
    output_len: int = 128  # chat: the median
    range_ratio: float = 0.0  # random/prefix: lengths uniform in [len*(1-r), len*(1+r)]
    prefix_len: int = 256
    num_prefix_groups: int = 4
    path: str | None = None  # jsonl
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def word_pool(tok) -> list[int]:
    """Ids of tokens that decode to ' word' (a space and ASCII letters): text made of them
    re-encodes to the same ids. Toy vocabularies fall back to printable ASCII tokens (which may
    merge when re-encoded, so prompts come out somewhat shorter)."""
    special = tok.all_special_ids if hasattr(tok, "all_special_ids") else frozenset()
    ids = []
    for i in range(tok.vocab_size):
        if i in special:
            continue
        s = tok.decode([i])
        if len(s) >= 3 and s[0] == " " and s[1:].isascii() and s[1:].isalpha():
            ids.append(i)
    if len(ids) >= 64:
        return ids
    printable = [i for i in range(tok.vocab_size) if i not in special]
    return [i for i in printable if (s := tok.decode([i])) and s.isascii() and s.isprintable()]


def _span(length: int, ratio: float, rng: random.Random) -> int:
    lo, hi = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return rng.randint(lo, hi)


def _text_request(tok, ids: list[int], output_len: int) -> BenchRequest:
    text = tok.decode(ids)
    return BenchRequest(text, tok.encode(text, add_special_tokens=False), output_len)


def random_dataset(tok, cfg: DatasetConfig) -> list[BenchRequest]:
    rng, pool = random.Random(cfg.seed), word_pool(tok)
    out = []
    for _ in range(cfg.num_prompts):
        ids = rng.choices(pool, k=_span(cfg.input_len, cfg.range_ratio, rng))
        out.append(_text_request(tok, ids, _span(cfg.output_len, cfg.range_ratio, rng)))
    return out


def prefix_dataset(tok, cfg: DatasetConfig) -> list[BenchRequest]:
    """`num_prefix_groups` shared prefixes of `prefix_len` tokens, each request one of them plus a
    unique suffix; groups are interleaved so a prefix cache must hold all of them at once."""
    rng, pool = random.Random(cfg.seed), word_pool(tok)
    prefixes = [rng.choices(pool, k=cfg.prefix_len) for _ in range(max(1, cfg.num_prefix_groups))]
    out = []
    for i in range(cfg.num_prompts):
        suffix = rng.choices(pool, k=_span(cfg.input_len, cfg.range_ratio, rng))
        out.append(
            _text_request(
                tok, prefixes[i % len(prefixes)] + suffix, _span(cfg.output_len, cfg.range_ratio, rng)
            )
        )
    return out


def _lognormal(rng: random.Random, median: int, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(max(1, median)), sigma)))))


def chat_dataset(tok, cfg: DatasetConfig) -> list[BenchRequest]:
    """A ShareGPT-like mix: log-normal prompt and reply lengths (long tails; medians input_len and
    output_len, capped at 8x), a third of them with an earlier turn, templated by the model."""
    rng, pool = random.Random(cfg.seed), word_pool(tok)
    out = []
    for _ in range(cfg.num_prompts):
        n_in = _lognormal(rng, cfg.input_len, 0.9, 4, 8 * cfg.input_len)
        n_out = _lognormal(rng, cfg.output_len, 0.7, 4, 8 * cfg.output_len)
        messages = []
        if rng.random() < 1 / 3:
            first = max(2, n_in // 3)
            messages += [
                {"role": "user", "content": tok.decode(rng.choices(pool, k=first)).strip()},
                {"role": "assistant", "content": tok.decode(rng.choices(pool, k=first)).strip()},
            ]
            n_in = max(2, n_in - 2 * first)
        messages.append({"role": "user", "content": tok.decode(rng.choices(pool, k=n_in)).strip()})
        out.append(_chat_request(tok, messages, n_out))
    return out


def _chat_request(tok, messages: list[dict[str, str]], output_len: int) -> BenchRequest:
    try:
        text = tok.apply_chat_template(messages)
    except ValueError:  # no template: plain concatenation is what a completions server would see
        text = "\n".join(m["content"] for m in messages)
    return BenchRequest(text, tok.encode(text, add_special_tokens=False), output_len, messages)


def _check_row(row, where: str) -> None:
    """A jsonl row's shape, so a wrong one is named with its line, not a traceback mid-build."""
    if not isinstance(row, dict) or ("prompt" not in row and "messages" not in row):
        raise ValueError(f"{where} needs a 'prompt' or 'messages' field")
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise ValueError(f"{where}: 'messages' must be a non-empty list of message objects")
    elif not isinstance(row["prompt"], str):
        raise ValueError(f"{where}: 'prompt' must be a string")
    n_out = row.get("output_len", row.get("max_tokens"))
    if n_out is not None and (not isinstance(n_out, int) or isinstance(n_out, bool) or n_out < 1):
        raise ValueError(f"{where}: 'output_len' / 'max_tokens' must be an integer >= 1")


def jsonl_dataset(tok, cfg: DatasetConfig) -> list[BenchRequest]:
    """One JSON object a line: {"prompt": str} or {"messages": [...]}, optionally "output_len"
    (or "max_tokens"); cycled if the file has fewer lines than num_prompts."""
    if not cfg.path:
        raise ValueError("dataset-path: the jsonl dataset needs a file")
    if not os.path.isfile(cfg.path):
        raise ValueError(f"dataset-path: {cfg.path!r} is not a file")
    rows = []
    with open(cfg.path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"dataset-path: {cfg.path} line {n} is not valid JSON: {e}") from None
            _check_row(row, f"dataset-path: {cfg.path} line {n}")
            rows.append(row)
    if not rows:
        raise ValueError(f"dataset-path: {cfg.path} has no prompts")
    out = []
    for i in range(cfg.num_prompts):
        row = rows[i % len(rows)]
        n_out = int(row.get("output_len", row.get("max_tokens", cfg.output_len)))
        if "messages" in row:
            out.append(_chat_request(tok, row["messages"], n_out))
        else:
            text = row["prompt"]
            out.append(BenchRequest(text, tok.encode(text, add_special_tokens=False), n_out))
    return out


def trace_dataset(tok, cfg: DatasetConfig) -> list[BenchRequest]:
    """An arrival trace replayed as `kvserve plan --simulate` reads it (kvserve/planner/trace.py):
    a JSONL path ({"t", "prompt_tokens", "output_tokens"} a line) or a `bursty:...` spec. Each
    request is sent at its `t` with a random-word prompt of its length and its output length
    (with --ignore-eos exactly), every line once (--num-prompts does not apply)."""
    from kvserve.planner.trace import load_trace

    if not cfg.path:
        raise ValueError("dataset-path: the trace dataset needs a JSONL file or a bursty:... spec")
    rng, pool = random.Random(cfg.seed), word_pool(tok)
    out = []
    for a in load_trace(cfg.path):
        req = _text_request(tok, rng.choices(pool, k=a.prompt_tokens), a.output_tokens)
        req.arrival_s = a.t
        out.append(req)
    return out


def build_dataset(tok, cfg: DatasetConfig) -> list[BenchRequest]:
    if cfg.num_prompts < 1:
        raise ValueError("num-prompts: must be at least 1")
    makers = {
        "random": random_dataset,
        "prefix": prefix_dataset,
        "chat": chat_dataset,
        "jsonl": jsonl_dataset,
        "trace": trace_dataset,
    }
    if cfg.name not in makers:
        raise ValueError(f"dataset: {cfg.name!r} is not one of {', '.join(DATASETS)}")
    return makers[cfg.name](tok, cfg)


def load_bench_tokenizer(name_or_path: str):
    """The tokenizer that builds the prompts: the same alias / GGUF / HF directory as `--model`."""
    from kvserve.model.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(name_or_path))
