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
