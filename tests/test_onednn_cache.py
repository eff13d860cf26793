"""The process that runs the model caps oneDNN's kernel caches (platform/onednn_cache.py), so a
long run's kernels stay bounded; a capacity the user set in the environment wins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from kvserve.platform.onednn_cache import CACHE_CAPACITY, CACHE_VARS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Build an engine, then run one packed projection over CACHE_CAPACITY + 8 row counts twice.
# oneDNN's verbose mode prints one "create:cache_miss" line per kernel it compiles: with the
# caps, the second pass compiles every shape again (each was evicted); at PyTorch's default
# of 1,024 entries it compiles none.
SCRIPT = textwrap.dedent(
    """
    import json, os, sys, torch
    from kvserve import LLM
    from kvserve.model.layers.linear import linear, onednn_pack
    LLM(sys.argv[1], kv_cache_memory="16MiB", max_model_len=128)
    w = torch.randn(96, 64)
    packed = onednn_pack(w)
    rows = range(1, int(sys.argv[2]) + 9)
    for n in rows:
        linear(torch.randn(n, 64), w, None, packed)
    print("SECOND PASS", json.dumps({k: os.environ.get(k) for k in sys.argv[3:]}), flush=True)
    for n in rows:
        linear(torch.randn(n, 64), w, None, packed)
    """
)


def _second_pass(model_dir: str, extra_env: dict[str, str]) -> tuple[dict, int]:
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARS}
    env.update(extra_env, ONEDNN_VERBOSE="profile_create")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, model_dir, str(CACHE_CAPACITY), *CACHE_VARS],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    values, rest = out.split("SECOND PASS ", 1)[1].split("\n", 1)
    compiled = sum("create:cache_miss" in ln and "inner_product" in ln for ln in rest.splitlines())
    return json.loads(values), compiled


def test_an_engine_process_caps_both_kernel_caches(tiny_llama_dir):
    values, recompiled = _second_pass(tiny_llama_dir, {})
    assert values == dict.fromkeys(CACHE_VARS, str(CACHE_CAPACITY))
    assert recompiled == CACHE_CAPACITY + 8  # bounded: every shape had been evicted


def test_a_capacity_set_by_the_user_wins(tiny_llama_dir):
    values, recompiled = _second_pass(tiny_llama_dir, dict.fromkeys(CACHE_VARS, "1024"))
    assert values == dict.fromkeys(CACHE_VARS, "1024")
    assert recompiled == 0  # every kernel still cached
