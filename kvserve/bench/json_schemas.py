"""Varied JSON schemas (seeded) for structured-output tests, acceptance runs and benchmarks.

Each schema mixes nested objects, arrays with min/max items, enums, integers and numbers
with ranges, string patterns and lengths, and required and optional fields. Strings are
bounded so a small model can finish them within a modest max_tokens.
"""

from __future__ import annotations

import random
from typing import Any

WORDS = ["name", "city", "color", "status", "level", "title", "tag", "kind", "owner", "label", "code", "mode"]
PATTERNS = [r"[A-Z][a-z]{2,8}", r"[a-z]{3,6}-[0-9]{2,4}", r"[0-9]{3}-[0-9]{4}", r"(red|green|blue)"]


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["int", "num", "enum", "pattern", "string", "bool"])
    if kind == "int":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 500)}
    if kind == "num":
        lo = rng.choice([-10.5, 0, 1.5, 100])
        return {"type": "number", "minimum": lo, "maximum": lo + rng.choice([1, 10, 1000])}
    if kind == "enum":
        return {
            "enum": rng.sample(
                ["alpha", "beta", "gamma", "delta", "x", "y", 1, 2, True, None], rng.randint(2, 5)
            )
        }
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 3), "maxLength": rng.randint(4, 16)}
    return {"type": "boolean"}


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(WORDS, rng.randint(2, 4))
    props: dict[str, Any] = {}
    for name in names:
        r = rng.random()
        if depth < 2 and r < 0.2:
            props[name] = _object(rng, depth + 1)
        elif r < 0.4:
            lo = rng.randint(0, 2)
            props[name] = {
                "type": "array",
                "items": _leaf(rng),
                "minItems": lo,
                "maxItems": lo + rng.randint(1, 3),
            }
        else:
            props[name] = _leaf(rng)
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": props, "required": required}


def varied_schemas(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [_object(rng, 0) for _ in range(n)]
