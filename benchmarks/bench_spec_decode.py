"""N-gram speculative decoding vs plain decoding, one request at a time (default model).

Three workloads, each request run alone through the offline engine, plain and speculative
engines in the same process, interleaved prompt by prompt:
- copy-heavy: rewrite a ~300-token passage with small edits, and continue a list / code
  snippet that repeats (the output re-uses long runs of its input);
- open-ended: short creative prompts (little to copy);
- json: the passage and the checklist turned into JSON under a schema (structured outputs:
  every draft is checked against the request's grammar, and one it refuses is cut there).
Decode tokens/s is (output tokens - 1) / (finish - first token), so prefill is excluded.
Greedy outputs must be identical (checked). Prints the speedup per workload and the
acceptance rate and mean acceptance length (tokens per verified step) of the drafts.

    python benchmarks/bench_spec_decode.py [--k 4] [--max-tokens 256] [--workloads copy,open,json]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine  # noqa: E402
from kvserve import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

PASSAGE = (
    "The harbour town of Kelmouth wakes before the sun. By four in the morning the bakers on "
    "Quay Street have lit their ovens, and the smell of bread drifts down to the water where the "
    "fishing boats are being readied. The harbour master, a tall woman named Agnes Tull, walks the "
    "length of the stone pier with a lantern, checking the moorings and writing the state of the "
    "tide in a small blue notebook. She has done this every day for twenty-two years. When the "
    "boats leave, the gulls follow them out past the lighthouse, and the town falls quiet again "
    "until the market opens at eight. The market is the heart of Kelmouth. Farmers bring eggs, "
    "cheese and vegetables from the hills; the fishmongers lay out the night's catch on beds of "
    "ice; and a man called Peter sells honey from his own hives, which he keeps on the cliffs "
    "above the bay. In summer the town fills with visitors who come for the beaches and the "
    "seafood, but in winter it belongs to its own people again, and the evenings are spent in the "
    "Anchor, the old inn by the harbour, where the fire is always lit and the stories are always "
    "the same."
)
LIST = "\n".join(
    f"{i}. Item {i}: check the {part} on unit {i}, record the reading, and sign the log."
    for i, part in enumerate(["valve", "pump", "filter", "gauge", "seal", "motor"], start=1)
)
CODE = """def area_square(side):
    return side * side


def area_rectangle(width, height):
    return width * height


def area_triangle(base, height):
    return 0.5 * base * height


def area_circle(radius):
    return 3.14159 * radius * radius

"""
COPY_TASKS = [
    [{"role": "user", "content": "Rewrite the following passage, changing the name Agnes Tull to "
      "Mary Penrose and the town Kelmouth to Porthwen. Keep everything else the same.\n\n" + PASSAGE}],
    [{"role": "user", "content": "Copy this passage exactly, but write 'harbor' instead of "
      "'harbour':\n\n" + PASSAGE}],
    [{"role": "user", "content": "Continue this maintenance checklist up to item 12, in the same "
      "format:\n\n" + LIST}],
    [{"role": "user", "content": "Repeat this Python code and add two more functions in the same "
      "style (area_trapezoid and area_ellipse):\n\n" + CODE}],
]  # fmt: skip
OPEN_TASKS = [
    [{"role": "user", "content": "Write a short story about a dragon who learns to cook."}],
    [{"role": "user", "content": "What are some good habits for staying healthy? Explain why."}],
    [{"role": "user", "content": "Describe your ideal holiday in a few paragraphs."}],
    [{"role": "user", "content": "Explain how a bicycle works to a ten-year-old."}],
]

PEOPLE = {
    "type": "array",
    "maxItems": 12,
    "items": {
        "type": "object",
        "required": ["name", "kind", "detail"],
        "additionalProperties": False,
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "kind": {"enum": ["person", "place", "business"]},
            "detail": {"type": "string", "maxLength": 120},
        },
    },
}
CHECKS = {
    "type": "array",
    "minItems": 6,
    "maxItems": 6,
    "items": {
        "type": "object",
        "required": ["item", "part", "unit", "steps"],
        "additionalProperties": False,
        "properties": {
            "item": {"type": "integer"},
            "part": {"type": "string", "maxLength": 20},
            "unit": {"type": "integer"},
            "steps": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 40}},
        },
    },
}
JSON_TASKS = [
    ([{"role": "user", "content": "List every person, place and business in this passage as JSON "
       "(name, kind, and a detail copied from the text):\n\n" + PASSAGE}], PEOPLE),
    ([{"role": "user", "content": "Turn this checklist into JSON: item number, part, unit and the "
       "three steps of each line.\n\n" + LIST}], CHECKS),
]  # fmt: skip


def decode_rate(out) -> tuple[int, float]:
    m = out.metrics
    return len(out.outputs[0].token_ids) - 1, m.finished_time - m.first_token_time


def run(plain: LLM, spec: LLM, tasks: list, params: SamplingParams) -> dict:
    stats = spec.llm_engine.core.scheduler.spec_stats
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    tokens = {"plain": 0, "spec": 0}
    secs = {"plain": 0.0, "spec": 0.0}
    for task in tasks:
        msgs, p = task, params
        if isinstance(task, tuple):  # (messages, JSON schema)
            msgs, schema = task
            p = dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=schema))
        outs = {}
        for name, llm in (("plain", plain), ("spec", spec)):
            out = llm.chat([msgs], p, use_tqdm=False)[0]
            n, s = decode_rate(out)
            tokens[name] += n
            secs[name] += s
            outs[name] = out.outputs[0].token_ids
        assert outs["plain"] == outs["spec"], "speculation changed a greedy output"
    drafts = stats.num_drafts - before[0]
    drafted = stats.num_draft_tokens - before[1]
    accepted = stats.num_accepted_tokens - before[2]
    plain_rate, spec_rate = tokens["plain"] / secs["plain"], tokens["spec"] / secs["spec"]
    return {
        "output_tokens": tokens["plain"] + len(tasks),
        "plain_decode_tok_per_s": plain_rate,
        "spec_decode_tok_per_s": spec_rate,
        "speedup": spec_rate / plain_rate,
        "drafts": drafts,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--workloads", default="copy,open,json", help="comma-separated: copy, open, json")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    workloads = {"copy": COPY_TASKS, "open": OPEN_TASKS, "json": JSON_TASKS}
    names = args.workloads.split(",")
    if not names or any(n not in workloads for n in names):
        ap.error(f"--workloads: choose from {', '.join(workloads)}")
    common = dict(kv_cache_memory="256MiB", max_num_seqs=1)
    plain = LLM("smollm2-135m", **common)
    spec = LLM("smollm2-135m", speculative_method="ngram", num_speculative_tokens=args.k, **common)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    run(plain, spec, COPY_TASKS[:1] + OPEN_TASKS[:1], SamplingParams(temperature=0, max_tokens=16))  # warm up
    results = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "k": args.k,
        **{name: run(plain, spec, workloads[name], params) for name in names},
    }
    for name in names:
        r = results[name]
        print(
            f"{name:>5}: plain {r['plain_decode_tok_per_s']:6.1f} tok/s, "
            f"ngram {r['spec_decode_tok_per_s']:6.1f} tok/s -> {r['speedup']:.2f}x; "
            f"acceptance {r['acceptance_rate']:.0%} of {r['draft_tokens']} draft tokens, "
            f"mean acceptance length {r['mean_acceptance_length']:.2f} ({r['output_tokens']} tokens)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
