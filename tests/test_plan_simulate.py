"""`kvserve plan --simulate`: the replica model against hand arithmetic, the autoscaler's
scale-up and drain on a burst, the SLO search, traces and the CLI. Pure Python, fast."""

from __future__ import annotations

import json
import re

import pytest

from kvserve.planner.cli import main
from kvserve.planner.simulate import ReplicaModel, ScalingPolicy, min_replicas_for_slo, simulate
from kvserve.planner.trace import Arrival, bursty, load_trace

MODEL = ReplicaModel(max_num_seqs=8, max_num_batched_tokens=256, step_overhead_s=0.01, token_s=0.001)
FIXED1 = ScalingPolicy(1, 1)


def test_one_request_costs_what_the_step_model_says():
    res = simulate([Arrival(0.0, 100, 5)], MODEL, FIXED1)
    assert res.ttft_s == [pytest.approx(0.01 + 0.001 * 100)]  # one prefill step
    assert res.makespan_s == pytest.approx(0.11 + 4 * 0.011)  # then four 1-token decode steps
    assert res.queue_s == [0.0] and res.replica_hours == pytest.approx(res.makespan_s / 3600)


def test_saturated_throughput_and_chunked_prefill():
    res = simulate([Arrival(0.0, 10, 400) for _ in range(16)], MODEL, FIXED1)
    # 8 seats decoding: 8 tokens a step of 0.01 + 8 * 0.001 s, so ~444 tokens/s for most of the run
    assert 400 < res.output_tokens_per_s < 8 / 0.018 * 1.01
    assert sorted(res.queue_s)[8] > 1.0  # the second eight waited for seats
    long = simulate([Arrival(0.0, 1000, 1)], MODEL, FIXED1)  # 4 steps of <= 256 prompt tokens
    assert long.ttft_s[0] == pytest.approx(4 * 0.01 + 0.001 * 1000)


def test_a_burst_scales_up_then_drains_back():
    calm = [Arrival(t * 2.0, 50, 20) for t in range(300)]
    burst = [Arrival(100 + i * 0.02, 50, 200) for i in range(600)]
    trace = sorted(calm + burst, key=lambda a: a.t)
    policy = ScalingPolicy(1, 6, target_saturation=0.8, interval_s=5, cold_start_s=10, scale_down_delay_s=30)
    res = simulate(trace, MODEL, policy)
    assert res.peak_replicas > 1 and res.scale_events >= 2  # up, and at least one drain down
    assert res.replica_hours < res.peak_replicas * res.makespan_s / 3600  # not all held to the end
    pinned = simulate(trace, MODEL, ScalingPolicy(1, 1))
    assert res.attainment(2.0) > pinned.attainment(2.0)
    slower = simulate(trace, MODEL, ScalingPolicy(1, 6, 0.8, 5, cold_start_s=120, scale_down_delay_s=30))
    assert slower.attainment(2.0) <= res.attainment(2.0)  # a cold start is paid in TTFT


def test_min_replicas_for_a_ttft_slo_is_the_smallest_that_meets_it():
    trace = bursty(
        "bursty:duration=120,rate=1,burst_rate=12,burst_every=60,burst_len=10,prompt=100,output=30"
    )
    policy = ScalingPolicy(1, 8, 0.8, 5, cold_start_s=20, scale_down_delay_s=30)
    fixed, auto = min_replicas_for_slo(trace, MODEL, policy, slo_s=1.0, target=0.95)
    assert fixed is not None and fixed > 1 and auto is not None and auto <= fixed
    pinned = lambda n: simulate(trace, MODEL, ScalingPolicy(n, n)).attainment(1.0)  # noqa: E731
    assert pinned(fixed) >= 0.95 > pinned(fixed - 1)


def test_traces(tmp_path):
    a, b = bursty("bursty:duration=60,seed=3"), bursty("bursty:duration=60,seed=3")
    assert a == b and a and all(x.t < 60 for x in a)
    assert bursty("bursty:duration=60,seed=4") != a
    good = tmp_path / "t.jsonl"
    rows = [
        '{"t": 1.5, "prompt_tokens": 10, "output_tokens": 2}',
        "",
        '{"t": 0, "prompt_tokens": 3, "output_tokens": 1}',
    ]
    good.write_text("\n".join(rows) + "\n")
    assert [x.t for x in load_trace(str(good))] == [0, 1.5]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 0, "prompt_tokens": 3, "output_tokens": 1}\n{"t": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected"):
        load_trace(str(bad))
    for row, says in [
        ('{"t": 0, "prompt_tokens": 10.5, "output_tokens": 1}', "prompt_tokens: 10.5 is not a whole number"),
        ('{"t": 0, "prompt_tokens": 3, "output_tokens": true}', "output_tokens: True is not a whole number"),
        ('{"t": 0, "prompt_tokens": "3", "output_tokens": 1}', "prompt_tokens: '3' is not a whole number"),
        ('{"t": "0", "prompt_tokens": 3, "output_tokens": 1}', "t: '0' is not a number"),
    ]:  # were read as 10, 1, 3 and 0
        bad.write_text(row + "\n")
        with pytest.raises(ValueError, match=re.escape(says)):
            load_trace(str(bad))
    with pytest.raises(ValueError, match="rate"):
        bursty("bursty:rat=2")


def test_cli(capsys):
    code = main(["--simulate", "bursty:duration=60,rate=1,burst_rate=5", "--max-num-seqs", "16",
                 "--cold-start", "10", "--scale-interval", "5", "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert code in (0, 1) and out["policy"]["requests"] > 0
    assert {"min_fixed_replicas_for_slo", "min_replicas_for_slo_with_autoscaling"} <= set(out)
    assert out["one_replica_output_tokens_per_s"] > 0
    assert main(["--simulate", "bursty:nope=1"]) == 2
    assert "expected key=value" in capsys.readouterr().err
    assert main([]) == 2 and "MODEL is required" in capsys.readouterr().err


def test_decoding_sequences_cost_their_own_rate():
    """decode_token_s prices a decoding sequence apart from a prompt token (None: token_s)."""
    model = ReplicaModel(8, 256, step_overhead_s=0.01, token_s=0.001, decode_token_s=0.004)
    one = simulate([Arrival(0.0, 100, 5)], model, FIXED1)
    assert one.ttft_s == [pytest.approx(0.11)] and one.makespan_s == pytest.approx(0.11 + 4 * 0.014)
    two = simulate([Arrival(0.0, 100, 5), Arrival(0.0, 100, 5)], model, FIXED1)
    # the second prompt joins the first's first decode step: 0.11 + (0.01 + 0.004 + 0.1)
    assert two.ttft_s == [pytest.approx(0.11), pytest.approx(0.224)]
    # then three steps decoding both (0.018 each) and one with the second alone (0.014)
    assert two.makespan_s == pytest.approx(0.224 + 3 * 0.018 + 0.014)
    same = ReplicaModel(8, 256, step_overhead_s=0.01, token_s=0.001)
    assert same.decode_s == 0.001


@pytest.mark.parametrize(
    "args, message",
    [
        # the model and --gpu changed nothing in a simulation, unsaid
        (
            ["Llama-3.1-8B", "--gpu", "L4", "--simulate", "bursty:duration=30"],
            "MODEL, --gpu: not used by --simulate",
        ),
        # and the autoscaler's flags nothing in a sizing plan
        (["Llama-3.1-8B", "--max-replicas", "3"], "--max-replicas: only used with --simulate TRACE"),
    ],
)
def test_options_of_the_other_mode_are_refused(args, message, capsys):
    assert main(args) == 2
    assert f"kvserve plan: error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        # each of these ran for ever (an infinite or NaN step time, rate or duration)
        (["--step-overhead-ms", "inf"], "argument --step-overhead-ms: must be a finite number, got 'inf'"),
        (["--simulate", "bursty:duration=inf"], "--simulate: duration: must be finite"),
        (["--simulate", "bursty:rate=nan"], "--simulate: rate: must be finite"),
        # a NaN step time simulated 0 tokens/s; a negative output length was "math domain error"
        (["--token-ms", "nan"], "argument --token-ms: must be a finite number, got 'nan'"),
        (["--simulate", "bursty:output=-5"], "--simulate: prompt and output must be >= 1"),
        # named --target-saturation too, which was fine
        (["--slo-target", "2"], "argument --slo-target: must be in (0, 1], got '2'"),
    ],
)
def test_non_finite_simulation_inputs_are_refused(args, message, capsys):
    argv = args if "--simulate" in args else ["--simulate", "bursty:duration=30", *args]
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == 2 and message in capsys.readouterr().err


HUGE_OUTPUT = '{"t": 0, "prompt_tokens": 10, "output_tokens": 1000000000000}'
LONG_SPAN = (
    '{"t": 0, "prompt_tokens": 1, "output_tokens": 1}\n{"t": 1e9, "prompt_tokens": 1, "output_tokens": 1}'
)
BILLION = ["--min-replicas", "1000000000", "--max-replicas", "1000000000"]


@pytest.mark.parametrize(
    "trace, args, message",
    [
        # each of these ran out of memory or for ever (killed after 60 s)
        ("/dev/zero", [], "/dev/zero:1: line longer than 4096 characters"),
        ("bursty:duration=1e9", [], "duration x the peak rate is 10,000,000,000 arrivals; at most 1,000,000"),
        ("bursty:duration=30", BILLION, "--min-replicas and --max-replicas must be <= 1024"),
        (
            HUGE_OUTPUT,
            [],
            "has 1,000,000,000,010 prompt + output tokens; at most 1,073,741,824 are simulated",
        ),
        (LONG_SPAN, [], "spans 1,000,000,000 s, 66,666,667 autoscaler decisions at --scale-interval 15"),
        (
            LONG_SPAN.replace("1e9", "1e308"),
            [],
            "spans 1e+308 s, 6.67e+306 autoscaler decisions",
        ),  # not 309 digits
        # the span was checked, not the run: a step of 1e297 s ticked the autoscaler for ever
        ("bursty:duration=60,rate=1", ["--token-ms", "1e300"], "would still be unfinished at 4.67e+299 s"),
        ("bursty:duration=60,rate=1", ["--step-overhead-ms", "1e300"], "past 1,000,000 autoscaler decisions"),
    ],
)
def test_simulation_size_is_bounded(trace, args, message, tmp_path, capsys):
    if trace.startswith("{"):
        (tmp_path / "t.jsonl").write_text(trace + "\n")
        trace = str(tmp_path / "t.jsonl")
    assert main(["--simulate", trace, *args]) == 2
    assert message in capsys.readouterr().err


def test_a_run_that_outlasts_the_autoscaler_bound_is_refused(monkeypatch):
    """Slow steps for the trace: the run stops at the last of MAX_TICKS decisions, saying so."""
    import kvserve.planner.sim_limits as limits

    monkeypatch.setattr(limits, "MAX_TICKS", 10)  # 150 s at 15 s a decision
    trace = [Arrival(0.0, 1, 100) for _ in range(10)]  # 1,000 steps of 1 s, one at a time
    slow = ReplicaModel(max_num_seqs=1, max_num_batched_tokens=16, step_overhead_s=1.0, token_s=0.0)
    with pytest.raises(ValueError, match=r"9 of 10 requests would still be unfinished at 151 s, past 10 "):
        simulate(trace, slow, FIXED1)
    assert simulate(trace[:1], slow, FIXED1).ttft_s == [1.0]  # 100 s: within the bound


def test_trace_file_request_count_is_bounded(tmp_path, monkeypatch):
    import kvserve.planner.trace as trace_mod

    monkeypatch.setattr(trace_mod, "MAX_REQUESTS", 3)
    path = tmp_path / "t.jsonl"
    path.write_text('{"t": 0, "prompt_tokens": 1, "output_tokens": 1}\n' * 3)
    assert len(load_trace(str(path))) == 3
    path.write_text('{"t": 0, "prompt_tokens": 1, "output_tokens": 1}\n' * 4)
    with pytest.raises(ValueError, match="more than 3 requests; at most that many are simulated"):
        load_trace(str(path))
