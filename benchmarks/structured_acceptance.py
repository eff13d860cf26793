"""Acceptance run for structured outputs: N varied JSON schemas (default 200) against a
running `kvserve serve`, every completed response validated with `jsonschema`.

    kvserve serve smollm2-135m --port 8000 &
    python benchmarks/structured_acceptance.py --url http://127.0.0.1:8000/v1 --num 200

Prints counts (completed / valid / cut by max_tokens) and exits 1 if any completed response
fails to parse or validate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import jsonschema
import openai

from kvserve.bench.json_schemas import varied_schemas


def prompt_for(schema: dict) -> list[dict]:
    fields = ", ".join(schema["properties"])
    return [{"role": "user", "content": f"Describe something as a JSON object with the fields {fields}."}]


async def one(client, model: str, i: int, schema: dict, max_tokens: int, sem) -> tuple[str, str | None]:
    async with sem:
        r = await client.chat.completions.create(
            model=model, messages=prompt_for(schema), max_tokens=max_tokens, temperature=0.7, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}},
        )  # fmt: skip
    c = r.choices[0]
    if c.finish_reason != "stop":
        return "cut", None
    try:
        jsonschema.validate(json.loads(c.message.content), schema)
    except (ValueError, jsonschema.ValidationError) as e:
        return (
            "invalid",
            f"schema {i}: {type(e).__name__}: {str(e)[:200]}\n  output: {c.message.content[:300]}",
        )
    return "valid", None


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    client = openai.AsyncOpenAI(base_url=args.url, api_key="unused", max_retries=0, timeout=3600)
    sem = asyncio.Semaphore(args.concurrency)
    schemas = varied_schemas(args.num, args.seed)
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(one(client, args.model, i, s, args.max_tokens, sem) for i, s in enumerate(schemas))
    )
    counts = {k: sum(1 for r, _ in results if r == k) for k in ("valid", "invalid", "cut")}
    for _, why in results:
        if why:
            print(why)
    completed = counts["valid"] + counts["invalid"]
    share = 100 * counts["valid"] / max(completed, 1)
    print(
        f"{args.num} schemas in {time.perf_counter() - t0:.0f}s: {completed} completed, {counts['valid']} "
        f"valid ({share:.1f}% of completed), {counts['cut']} cut by max_tokens"
    )
    await client.close()
    return 1 if counts["invalid"] else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
