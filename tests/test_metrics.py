"""ServerMetrics fed directly (no server): what /metrics renders for given engine outputs."""

from __future__ import annotations

from kvserve.engine.messages import EngineCoreOutputs
from kvserve.metrics.prometheus import ServerMetrics
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput


def output(rid: str, new: list[int], finish: str | None = None, prompt: int = 5) -> RequestOutput:
    m = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.1, first_token_time=0.3)
    if finish is not None:
        m.finished_time = 1.0
    c = CompletionOutput(0, "", list(new), finish_reason=finish, delta_token_ids=list(new))
    return RequestOutput(rid, None, list(range(prompt)), [c], finish is not None, m)


def sample(metrics: ServerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "tiny", **labels})


def test_an_aborted_request_is_counted_and_forgotten():
    metrics = ServerMetrics("tiny")
    metrics.on_step(EngineCoreOutputs([]), [output("a", [7, 8])])
    assert metrics._last_token_time  # kept for the inter-token latency of its next token
    metrics.on_abort(output("a", [], "abort"))
    assert sample(metrics, "kvserve:request_success_total", finished_reason="abort") == 1
    assert sample(metrics, "kvserve:e2e_request_latency_seconds_count") == 1
    assert not metrics._last_token_time and not metrics._engine_of  # nothing kept per aborted request


def test_vllm_names_cover_what_vllms_grafana_dashboard_reads():
    """--metrics-compat vllm: the series vLLM's examples/.../grafana.json queries, each parsed
    from the exposition (a family split or named wrong would not parse or not be found)."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvserve.metrics.vllm_names import vllm_series

    metrics = ServerMetrics("tiny")
    metrics.on_step(EngineCoreOutputs([]), [output("a", [7])])
    metrics.on_step(EngineCoreOutputs([]), [output("a", [7, 8, 9], "length", prompt=40)])
    metrics.on_step(EngineCoreOutputs([], num_running=1, kv_cache_usage=0.25, iteration_tokens=9), [])
    body = metrics.render()
    families = {f.name: f for f in text_string_to_metric_families((body + vllm_series(body)).decode())}
    for name, kind in {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:gpu_cache_usage_perc": "gauge",
        "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram", "vllm:time_per_output_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
        "vllm:request_prefill_time_seconds": "histogram", "vllm:request_decode_time_seconds": "histogram",
        "vllm:request_inference_time_seconds": "histogram", "vllm:iteration_tokens_total": "histogram",
        "vllm:request_time_per_output_token_seconds": "histogram",
        "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
        "vllm:num_preemptions": "counter",
    }.items():  # fmt: skip
        assert families[name].type == kind, name
    values = {(s.name, s.labels.get("le")): s.value for f in families.values() for s in f.samples}
    assert values[("vllm:gpu_cache_usage_perc", None)] == 0.25
    assert values[("vllm:request_prompt_tokens_bucket", "50.0")] == 1  # 40 prompt tokens
    assert values[("vllm:request_prompt_tokens_bucket", "20.0")] == 0
    assert values[("vllm:request_generation_tokens_sum", None)] == 3
    assert values[("vllm:request_decode_time_seconds_sum", None)] == 0.7
    assert values[("vllm:time_per_output_token_seconds_count", None)] == 1
    assert values[("vllm:request_time_per_output_token_seconds_sum", None)] == 0.35  # 0.7 s over 2 tokens
    assert values[("vllm:iteration_tokens_total_sum", None)] == 9


def test_an_embedding_counts_its_prompt_tokens():
    """As vLLM's prompt_tokens_total: an embedding request computes its prompt but samples no
    token, and its prompt was counted only at a first token (so never)."""
    metrics = ServerMetrics("tiny")
    done = output("e", [], "stop", prompt=12)
    done.embedding = [0.5, 0.5]
    metrics.on_step(EngineCoreOutputs([]), [done])
    assert sample(metrics, "kvserve:prompt_tokens_total") == 12
    assert sample(metrics, "kvserve:request_queue_time_seconds_count") == 1
    assert sample(metrics, "kvserve:generation_tokens_total") in (None, 0)


def test_batch_lines_are_not_interactive_load_nor_interactive_latency():
    """A batch alone (its lines yield to interactive requests) pushed kvserve:saturation to ~1
    (an HPA targeting 0.8 scaled out, the gateway shed or fell back) and filled the TTFT / e2e /
    queue-time histograms. Its lines now have gauges of their own, are left out of running,
    waiting and saturation, and out of the latency histograms (still counted as requests)."""
    for engines in (1, 2):
        metrics = ServerMetrics("tiny", num_engines=engines, max_num_seqs=64)
        labels = {"engine": "0"} if engines > 1 else {}
        core = dict(num_running=64, num_waiting=30, kv_cache_usage=0.9, num_running_background=64,
                    num_waiting_background=30, kv_cache_usage_background=0.9)  # fmt: skip
        metrics.on_step(EngineCoreOutputs([], **core), [])
        assert sample(metrics, "kvserve:saturation", **labels) == 0
        assert sample(metrics, "kvserve:num_requests_running", **labels) == 0
        assert sample(metrics, "kvserve:num_requests_waiting", **labels) == 0
        assert sample(metrics, "kvserve:num_batch_requests_running", **labels) == 64
        assert sample(metrics, "kvserve:num_batch_requests_waiting", **labels) == 30
        assert sample(metrics, "kvserve:kv_cache_usage_perc", **labels) == 0.9  # the pool's own
        core.update(num_running=65, num_waiting=32, kv_cache_usage=0.95)  # one interactive runs, 2 wait
        metrics.on_step(EngineCoreOutputs([], **core), [])
        assert sample(metrics, "kvserve:num_requests_running", **labels) == 1
        assert abs(sample(metrics, "kvserve:saturation", **labels) - (0.05 + 2 / 64)) < 1e-9
    line, asked = output("b", [7]), output("i", [7])
    line.metrics.background = True
    metrics = ServerMetrics("tiny")
    metrics.on_step(EngineCoreOutputs([]), [line, asked])
    line, asked = output("b", [7, 8], "length"), output("i", [7, 8], "length")
    line.metrics.background = True
    metrics.on_step(EngineCoreOutputs([]), [line, asked])
    for name in ("time_to_first_token", "request_queue_time", "e2e_request_latency", "inter_token_latency"):
        assert sample(metrics, f"kvserve:{name}_seconds_count") == 1, name
    assert sample(metrics, "kvserve:request_success_total", finished_reason="length") == 2
