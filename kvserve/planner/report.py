"""Rendering of a Plan: a readable table for people, a JSON dict for scripts.

Both read the same Plan object, so the two outputs cannot drift apart. Byte sizes
in the table use binary units (KiB, MiB, GiB), like `--kv-cache-memory` and the
engine; the JSON carries raw byte counts.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvserve.planner.plan import Plan

ESTIMATE_NOTE = (
    "roofline estimate, an upper bound: max(bytes moved / HBM bandwidth, FLOPs / peak) per "
    "decode step; real engines typically reach 50-70% of it"
)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def to_dict(plan: Plan) -> dict[str, Any]:
    """JSON-ready view of the plan (raw numbers, bytes, tokens, USD)."""
    spec, mem, layout, prec = plan.model, plan.memory, plan.layout, plan.precision
    pool = mem.pool
    return {
        "model": {
            "name": spec.name,
            "source": spec.source,
            "total_params": spec.total_params,
            "active_params": spec.active_params,
            "moe": spec.is_moe,
            **{k: v for k, v in asdict(spec).items() if k not in ("name", "source")},
        },
        "settings": {
            "gpu": plan.gpu.name if plan.gpu else None,
            "compute_dtype": prec.compute,
            "weight_dtype": prec.weights,
            "kv_cache_dtype": prec.kv_cache,
            "max_model_len": plan.max_model_len,
            "context_len": plan.context_len,
            "block_size": pool.block_size,
            "gpu_memory_utilization": plan.request.gpu_memory_utilization,
            "overhead": plan.request.overhead,
            "concurrency": plan.request.concurrency,
            "kv_cache_memory": plan.request.kv_cache_memory,
        },
        "gpu": asdict(plan.gpu) if plan.gpu else None,
        "memory": {
            "weight_bytes": plan.weight_bytes,
            "kv_bytes_per_token": plan.kv_bytes_per_token,
            "kv_bytes_per_sequence": plan.kv_bytes_per_token * plan.max_model_len,
            "per_gpu": {
                "gpu_memory_bytes": mem.gpu_memory_bytes,
                "usable_bytes": mem.usable_bytes,
                "weight_bytes": mem.weight_bytes,
                "overhead_bytes": mem.overhead_bytes,
                "kv_cache_bytes": mem.kv_cache_bytes,
                "kv_bytes_per_token": mem.kv_bytes_per_token,
            },
            "fits": mem.fits,
        },
        "kv_pool": {
            "num_blocks": pool.num_blocks,
            "block_size": pool.block_size,
            "num_tokens": pool.num_tokens,
            "total_bytes": pool.total_bytes,
            "bytes_per_token": pool.bytes_per_token,
            "max_concurrency": mem.max_concurrency,
        },
        "layout": None
        if layout is None
        else {
            "tensor_parallel": mem.tensor_parallel,
            "pipeline_parallel": mem.pipeline_parallel,
            "expert_parallel": layout.expert_parallel,
            "gpus_per_replica": layout.gpus_per_replica,
            "replicas": layout.replicas,
            "num_gpus": layout.num_gpus,
            "nodes": layout.nodes,
            "fits": layout.fits,
            "decision": layout.decision,
        },
        "throughput": {
            "estimate": True,
            "note": ESTIMATE_NOTE,
            "context_len": plan.context_len,
            "points": [asdict(p) for p in plan.throughput],
        },
        "cost": asdict(plan.cost) if plan.cost else None,
    }


def _rows(title: str, rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(k) for k, _ in rows)
    return [title, *(f"  {k:<{width}}  {v}" for k, v in rows), ""]


def _model_rows(plan: Plan) -> list[str]:
    s, p = plan.model, plan.precision
    params = fmt_count(s.total_params)
    if s.is_moe:
        active = fmt_count(s.active_params)
        params += f" total, {active} active ({s.num_experts} experts, top-{s.experts_per_token})"
    shape = f"{s.num_layers} layers, hidden {s.hidden_size}, {s.num_heads} heads / {s.num_kv_heads} KV heads"
    shape += f", head_dim {s.head_dim}, vocab {s.vocab_size}, ffn {s.intermediate_size}"
    rows = [("model", f"{s.name} ({s.source})"), ("shape", shape), ("parameters", params)]
    rows.append(("dtypes", f"compute {p.compute}, weights {p.weights}, KV cache {p.kv_cache}"))
    gpu = plan.gpu
    if gpu:
        rows.append(("GPU", f"{gpu.name}: {fmt_bytes(gpu.memory_bytes)}, {gpu.bandwidth_gbps:g} GB/s"))
    return _rows("Model", rows)


def _memory_rows(plan: Plan) -> list[str]:
    mem, n = plan.memory, plan.max_model_len
    rows = [
        ("weights (whole model)", fmt_bytes(plan.weight_bytes)),
        ("KV per token", fmt_bytes(plan.kv_bytes_per_token)),
        (f"KV per sequence ({n} tok)", fmt_bytes(plan.kv_bytes_per_token * n)),
    ]
    if mem.usable_bytes is not None:
        frac = plan.request.gpu_memory_utilization
        rows += [
            (
                "per GPU: usable",
                f"{fmt_bytes(mem.usable_bytes)} ({frac:.0%} of {fmt_bytes(mem.gpu_memory_bytes)})",
            ),
            ("per GPU: weights", fmt_bytes(mem.weight_bytes)),
            ("per GPU: activations/overhead", fmt_bytes(mem.overhead_bytes)),
            ("per GPU: KV cache", fmt_bytes(mem.kv_cache_bytes)),
        ]
    return _rows("Memory", rows)


def _pool_rows(plan: Plan) -> list[str]:
    mem, pool = plan.memory, plan.memory.pool
    rows = [
        ("blocks", f"{pool.num_blocks} x {pool.block_size} tokens"),
        ("tokens", str(pool.num_tokens)),
        (
            "bytes",
            f"{fmt_bytes(pool.total_bytes)} ({pool.total_bytes} B, {pool.bytes_per_token} B/token/GPU)",
        ),
        (f"max concurrency @ {plan.max_model_len}", f"{mem.max_concurrency:.2f} sequences"),
        ("fits", "yes" if mem.fits else "no (needs room for one max_model_len sequence)"),
    ]
    return _rows("KV pool (as the engine allocates it)", rows)


def _layout_rows(plan: Plan) -> list[str]:
    lay, mem = plan.layout, plan.memory
    if lay is None:
        return []
    rows = [
        ("decision", lay.decision),
        (
            "tensor x pipeline",
            f"TP {mem.tensor_parallel} x PP {mem.pipeline_parallel} (EP {lay.expert_parallel})",
        ),
        ("replicas", f"{lay.replicas} -> {lay.num_gpus} GPU(s), {lay.nodes} node(s)"),
    ]
    if lay.replicas < 1:
        rows[-1] = ("replicas", f"none: a replica needs {lay.gpus_per_replica} GPUs, {lay.num_gpus} given")
    return _rows("Deployment", rows)


def _throughput_rows(plan: Plan) -> list[str]:
    if not plan.throughput:
        return []
    head = f"Decode throughput, ESTIMATE at {plan.context_len} tokens of context per sequence"
    lines = [
        head,
        f"  ({ESTIMATE_NOTE})",
        f"  {'batch/replica':>13}  {'step ms':>8}  {'tokens/s (all)':>14}  bound",
    ]
    for p in plan.throughput:
        lines.append(f"  {p.batch_size:>13}  {p.step_ms:>8.2f}  {p.tokens_per_s:>14.0f}  {p.bound}")
    return [*lines, ""]


def _cost_rows(plan: Plan) -> list[str]:
    c = plan.cost
    if c is None:
        return []
    rows = [
        ("price", f"${c.price_per_gpu_hour:.2f}/GPU-h x {c.num_gpus} GPU(s)"),
        ("monthly (730 h)", f"${c.monthly_cost:,.0f}"),
        ("per 1M output tokens, saturated", f"${c.cost_per_m_output_tokens:.3f}"),
        (f"capacity @ {c.utilization:.0%} utilisation", f"{fmt_count(c.capacity_tokens_per_day)} tokens/day"),
        (
            f"per 1M tokens @ {c.utilization:.0%}",
            f"${c.self_host_cost_per_m_tokens:.3f} ({c.input_share:.0%} input)",
        ),
    ]
    if c.api_price_per_m_tokens is not None:
        rows.append(("API, blended per 1M tokens", f"${c.api_price_per_m_tokens:.3f}"))
        if c.break_even_tokens_per_day is not None:
            util = f" (needs {c.break_even_utilization:.1%} utilisation)"
            rows.append(("break-even", f"{fmt_count(c.break_even_tokens_per_day)} tokens/day{util}"))
        else:
            rows.append(("break-even", "never at this utilisation: the API is cheaper per token"))
    if c.tokens_per_day is not None:
        rows.append(
            (
                f"at {fmt_count(c.tokens_per_day)} tokens/day",
                f"self-host ${c.self_host_monthly_cost:,.0f}/month ({c.deployments_needed} deployment(s))",
            )
        )
        if c.api_monthly_cost is not None:
            rows.append(("", f"API ${c.api_monthly_cost:,.0f}/month"))
    return _rows("Cost (USD)", rows)


def render_table(plan: Plan) -> str:
    """The human-readable report."""
    parts = [_model_rows(plan), _memory_rows(plan), _pool_rows(plan), _layout_rows(plan)]
    parts += [_throughput_rows(plan), _cost_rows(plan)]
    return "\n".join(line for part in parts for line in part).rstrip() + "\n"
