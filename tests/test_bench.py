"""`kvserve bench`: metrics against a stub with known timings, client speed, datasets, and runs
against real servers (kvserve and the naive transformers baseline) on a tiny random model."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import time

import httpx
import pytest
from server_utils import ServerProcess, free_port

from kvserve import LLM, SamplingParams
from kvserve.bench.datasets import DatasetConfig, build_dataset, load_bench_tokenizer
from kvserve.bench.loadgen import LoadConfig, RequestResult, arrival_gaps, run_load, schedule
from kvserve.bench.metrics import compute_metrics
from kvserve.bench.slo import parse_slo
from kvserve.entrypoints.cli import main as kvserve_main

HERE = os.path.dirname(os.path.abspath(__file__))
TTFT_MS, ITL_MS = 200.0, 20.0  # the stub's sleeps: each time the client sees is at least this


class Stub:
    """tests/bench_stub.py in its own process, so its timing does not share our GIL."""

    def __init__(self, ttft_ms: float, itl_ms: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "bench_stub.py"), "--port", str(self.port),
             "--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms)]
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        self.proc.kill()
        raise TimeoutError("stub server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def timed_stub():
    s = Stub(TTFT_MS, ITL_MS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def instant_stub():
    s = Stub(0, 0)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tiny_tok(tiny_llama_dir):
    return load_bench_tokenizer(tiny_llama_dir)


def _requests(tok, n: int, output_len: int, name: str = "random"):
    return build_dataset(tok, DatasetConfig(name=name, num_prompts=n, input_len=16, output_len=output_len))


def _run(cfg: LoadConfig, requests, warmup: int = 0, count_tokens=None):
    import asyncio

    return asyncio.run(run_load(cfg, requests, warmup=warmup, count_tokens=count_tokens))


def _close(measured: float, truth: float, tol: float = 0.05) -> bool:
    return abs(measured - truth) <= tol * truth


def _timed(measured: float, truth: float, early: float = 0.02, late: float = 0.5) -> bool:
    """A time the client measured against the stub's sleep: never much earlier, and later by up
    to `late` (a loaded 2-core CI host delays a stream by tens of ms; the quantities told apart
    here, 0 / 20 / 200 / 580 ms, differ by far more)."""
    return truth * (1 - early) <= measured <= truth * (1 + late)


def _sent_on_time(start: float, due: float) -> bool:
    """A request sent at its due time (seconds from the run's start): not before it, and late by
    less than a loaded host's scheduling delay, far less than the gaps these tests space them."""
    return due - 0.02 <= start <= due + 0.15


# ---- metrics against known timings -----------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_metrics_match_stub_timings(timed_stub, tiny_tok, endpoint):
    """8 requests of 20 tokens, 4 at a time: two waves, each request 200 + 19 * 20 = 580 ms."""
    n, out_len, conc = 8, 20, 4
    cfg = LoadConfig(timed_stub.url, "stub", endpoint=endpoint, max_concurrency=conc, progress=False)
    # warm-up opens the 4 keep-alive connections (a fresh TCP connection adds ~3 ms here)
    results, duration = _run(cfg, _requests(tiny_tok, n, out_len), warmup=conc)
    m = compute_metrics(results, duration, parse_slo("ttft:250,tpot:25"))
    per_request_s = (TTFT_MS + (out_len - 1) * ITL_MS) / 1000
    assert m["completed"] == n and m["failed"] == 0
    assert m["total_output_tokens"] == n * out_len  # from the usage chunk
    assert _timed(m["ttft_ms"]["mean"], TTFT_MS) and _timed(m["ttft_ms"]["p50"], TTFT_MS), m["ttft_ms"]
    # a token the client reads late shortens the gap after it: gaps may read early too
    assert _timed(m["itl_ms"]["mean"], ITL_MS, early=0.25) and _timed(m["itl_ms"]["p50"], ITL_MS, early=0.25)
    assert _timed(m["tpot_ms"]["mean"], ITL_MS, early=0.25), m["tpot_ms"]
    assert _timed(m["e2el_ms"]["mean"], per_request_s * 1000), m["e2el_ms"]
    assert len([x for r in results for x in r.itl]) == n * (out_len - 1)
    # the stub's timings bound the rates from above; load only lowers them
    truth_tput = n * out_len / (n / conc * per_request_s)
    assert _timed(truth_tput, m["output_throughput"]), (m["output_throughput"], truth_tput)
    assert _timed(n / (n / conc * per_request_s), m["request_throughput"]), m["request_throughput"]
    assert m["good_requests"] == n  # every request meets 250 ms TTFT and 25 ms TPOT
    assert compute_metrics(results, duration, parse_slo("ttft:150"))["good_requests"] == 0


def test_several_choices_are_separate_itl_series(timed_stub, tiny_tok):
    """n = 2: both choices' tokens arrive together every 20 ms. Each choice is its own series
    (the gap between choice 0's token and choice 1's, ~0 ms, is nobody's latency: it halved
    the ITL), every choice's tokens count, and TPOT is per choice."""
    n, out_len = 2, 10
    cfg = LoadConfig(timed_stub.url, "stub", max_concurrency=2, progress=False, extra_body={"n": 2})
    results, duration = _run(cfg, _requests(tiny_tok, n, out_len))
    m = compute_metrics(results, duration)
    assert m["completed"] == n and m["total_output_tokens"] == n * 2 * out_len
    assert [len(r.itl) for r in results] == [2 * (out_len - 1)] * n  # was 2 * out_len - 1
    assert m["itl_ms"]["p50"] > ITL_MS / 2 and m["tpot_ms"]["mean"] > ITL_MS / 2
    assert [r.choices for r in results] == [2] * n
    # with no usage chunk, each choice's text is counted (here by words: 10 each)
    cfg.extra_body["stream_options"] = {"include_usage": False}
    results, duration = _run(cfg, _requests(tiny_tok, n, out_len), count_tokens=lambda t: len(t.split()))
    assert [r.output_tokens for r in results] == [2 * out_len] * n


def test_client_sustains_5000_tokens_per_second(instant_stub, tiny_tok):
    """One client core against a stub that streams as fast as it can: the client is the limit."""
    n, out_len = 16, 2000
    cfg = LoadConfig(instant_stub.url, "stub", progress=False)
    results, duration = _run(cfg, _requests(tiny_tok, n, out_len))
    m = compute_metrics(results, duration)
    assert m["completed"] == n
    assert sum(len(r.itl) + 1 for r in results) == n * out_len  # every event was parsed
    print(f"client: {m['output_throughput']:,.0f} streamed tokens/s")
    assert m["output_throughput"] >= 5000


def test_request_rate_and_burstiness():
    """Gamma gaps keep the mean rate; the coefficient of variation is 1/sqrt(burstiness)."""
    for burst in (1.0, 0.25, 4.0):
        gaps = arrival_gaps(20001, 50.0, burst, seed=1)[1:]
        assert _close(statistics.fmean(gaps), 1 / 50, 0.03)
        assert _close(statistics.pstdev(gaps) / statistics.fmean(gaps), 1 / math.sqrt(burst), 0.05)
    assert arrival_gaps(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]


def test_request_rate_spreads_sends(instant_stub, tiny_tok):
    cfg = LoadConfig(instant_stub.url, "stub", request_rate=20.0, progress=False)
    results, duration = _run(cfg, _requests(tiny_tok, 10, 4))
    starts = [r.start for r in results]
    gaps = arrival_gaps(10, 20.0, 1.0, 0)
    assert all(_sent_on_time(s, sum(gaps[: i + 1])) for i, s in enumerate(starts)), (starts, gaps)


def test_metrics_summary_and_slo_parsing():
    rs = [
        RequestResult(True, "", 10, 11, 0.0, ttft=t, latency=t + 1.0, itl=[0.1] * 10) for t in (0.1, 0.2, 0.3)
    ]
    rs.append(RequestResult(False, "HTTP 500: boom"))
    m = compute_metrics(rs, 2.0, {"ttft": 250.0})
    assert (m["completed"], m["failed"], m["errors"]) == (3, 1, ["HTTP 500: boom"])
    assert m["ttft_ms"]["mean"] == pytest.approx(200.0) and m["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert m["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert m["output_throughput"] == pytest.approx(33 / 2.0)
    assert (m["good_requests"], m["goodput"]) == (2, pytest.approx(1.0))
    assert parse_slo("ttft:500,tpot:50") == {"ttft": 500.0, "tpot": 50.0}
    for bad in ("ttft", "latency:5", "ttft:x", "tpot:-1"):
        with pytest.raises(ValueError, match="slo"):
            parse_slo(bad)


# ---- datasets --------------------------------------------------------------------------------


def test_datasets(tiny_tok, tmp_path):
    rnd = build_dataset(tiny_tok, DatasetConfig("random", 20, 40, 30, range_ratio=0.5, seed=3))
    assert all(15 <= r.output_len <= 45 for r in rnd) and len({r.output_len for r in rnd}) > 1
    assert all(8 <= r.prompt_len <= 70 for r in rnd) and len({r.text for r in rnd}) == 20
    assert [r.text for r in rnd] == [
        r.text for r in build_dataset(tiny_tok, DatasetConfig("random", 20, 40, 30, 0.5, seed=3))
    ]
    pre = build_dataset(tiny_tok, DatasetConfig("prefix", 8, 10, 5, prefix_len=50, num_prefix_groups=2))
    assert pre[0].text[:40] == pre[2].text[:40] != pre[1].text[:40]
    chat = build_dataset(tiny_tok, DatasetConfig("chat", 30, 20, 20))
    assert all(r.messages and r.messages[-1]["role"] == "user" for r in chat)
    assert any(len(r.messages) == 3 for r in chat) and len({r.output_len for r in chat}) > 5
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "hello world", "output_len": 7}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n'
    )
    js = build_dataset(tiny_tok, DatasetConfig("jsonl", 3, output_len=9, path=str(path)))
    assert [r.output_len for r in js] == [7, 9, 7] and js[1].messages and js[0].text == "hello world"
    with pytest.raises(ValueError, match="dataset-path"):
        build_dataset(tiny_tok, DatasetConfig("jsonl", 3))


def test_jsonl_dataset_errors_name_the_file_and_line(tiny_tok, tmp_path):
    def build(path):
        return build_dataset(tiny_tok, DatasetConfig("jsonl", 2, path=str(path)))

    with pytest.raises(ValueError, match="dataset-path: .* is not a file"):
        build(tmp_path)  # was an IsADirectoryError
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\nnot json\n')
    with pytest.raises(ValueError, match=re.escape(f"dataset-path: {bad} line 2 is not valid JSON")):
        build(bad)
    bad.write_text('{"messages": "hi"}\n')
    with pytest.raises(ValueError, match="line 1: 'messages' must be a non-empty list"):
        build(bad)  # was an AttributeError in the chat template


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--save-result", "{tmp}/no-dir/x.json", "'{tmp}/no-dir/x.json': no such directory"),
        ("--max-concurrency", "-1", "must be >= 1, got -1"),  # was "Semaphore initial value must be >= 0"
        # these were silently changed: a length of 0 ran as 1, a negative warm-up as none
        ("--output-len", "0", "must be >= 1, got 0"),
        ("--input-len", "-4", "must be >= 1, got -4"),
        # a 20-digit length was an OverflowError traceback; 1e14 prompts were built for minutes on end
        ("--input-len", str(10**20), "must be <= 10,000,000 (past any model's context), got " + str(10**20)),
        ("--output-len", str(10**20), "must be <= 10,000,000 (past any model's context)"),
        ("--prefix-len", str(10**20), "must be <= 10,000,000 (past any model's context)"),
        ("--num-prompts", str(10**14), "must be <= 1,000,000 (a million requests a run), got " + str(10**14)),
        ("--warmup", "-1", "must be >= 0, got -1"),
        ("--extra-body", "nope", "not valid JSON"),  # a bare JSON error naming no flag, after the setup
        ("--extra-body", "[1]", "must be a JSON object"),
        # NaN: --burstiness hung (random.gammavariate(nan) never returns), --request-rate sent all
        # at once and wrote NaN (not JSON) into the result, --temperature went as null (1.0)
        ("--burstiness", "nan", "must be a finite number, got 'nan'"),
        ("--request-rate", "nan", "must be > 0 (or inf), got 'nan'"),
        ("--temperature", "nan", "must be a finite number, got 'nan'"),
        ("--range-ratio", "-0.5", "must be >= 0, got -0.5"),  # was "empty range for randrange()"
        ("--range-ratio", "1.5", "must be < 1"),  # lengths below 1 were raised to 1: skewed, not spread
        # ran, every request failing with aiohttp's NonHttpUrlClientError, then a report of dashes
        ("--base-url", "localhost:8000", "'localhost:8000' is not an http:// or https:// URL (did you mean"),
        ("--base-url", "ftp://host/v1", "'ftp://host/v1' is not an http:// or https:// URL"),
        # nan failed every request's SLO, inf passed every one, each written as NaN / Infinity (no
        # JSON) into the result; a key given twice kept its last value; all found after the prompts
        ("--slo", "ttft:nan", "ttft must be a positive number of milliseconds, got 'nan'"),
        ("--slo", "ttft:500,e2el:inf", "e2el must be a positive number of milliseconds, got 'inf'"),
        ("--slo", "ttft:500,ttft:100", "ttft is given twice"),
        ("--slo", "ttfb:5", "'ttfb:5' must be KEY:MS with KEY one of ttft, tpot, itl, e2el"),
    ],
)
def test_serve_arguments_are_checked_before_the_run(flag, value, message, tmp_path, capsys):
    url = "http://127.0.0.1:1"  # nothing listens: a run would fail differently
    with pytest.raises(SystemExit) as e:
        kvserve_main(["bench", "serve", "--base-url", url, flag, value.format(tmp=tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"error: argument {flag}: {message.format(tmp=tmp_path)}" in err


@pytest.mark.parametrize(
    "args, message",
    [
        # a sweep ran in full, then its plot was a FileNotFoundError traceback
        (["sweep", "--concurrencies", "1", "--plot", "{tmp}/no-dir/s.png"], "argument --plot: "),
        (
            ["offline", "--max-num-seqs", "0"],
            "argument --max-num-seqs: must be >= 1, got 0",
        ),  # ran as default
        # inf was an OverflowError traceback; 0.5 ran with no cap, recorded as concurrency 0.5
        (["sweep", "--concurrencies", "inf"], "concurrencies: 'inf' must be whole numbers >= 1"),
        (["sweep", "--concurrencies", "1,0.5"], "concurrencies: '1,0.5' must be whole numbers >= 1"),
        (["sweep", "--base-url", "127.0.0.1:9"], "argument --base-url: '127.0.0.1:9' is not an http:// or"),
    ],
)
def test_sweep_and_offline_arguments_are_checked_before_the_run(
    args, message, tiny_llama_dir, tmp_path, capsys
):
    url = ["--base-url", "http://127.0.0.1:1"] if args[0] == "sweep" else ["--model", str(tmp_path / "none")]
    argv = ["bench", *[a.format(tmp=tmp_path) for a in args], *url, "--tokenizer", tiny_llama_dir]
    try:
        rc = kvserve_main(argv + ["--num-prompts", "1", "--disable-tqdm"] * (args[0] == "sweep"))
    except SystemExit as e:
        rc = e.code
    assert rc == 2 and message.format(tmp=tmp_path) in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        # --model is what the server answers to; the error said only "model: 'tiny' not found"
        ([], "error: tokenizer: --model 'tiny' is no local model"),
        (["--tokenizer", "nope"], "error: tokenizer: 'nope' not found"),  # was "model: 'nope' ..."
    ],
)
def test_a_missing_tokenizer_names_the_tokenizer_flag(extra, message, capsys):
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:1", "--model", "tiny", "--num-prompts", "1"]
    assert kvserve_main(argv + extra) == 2
    err = capsys.readouterr().err
    assert message in err and ("--tokenizer" in err or extra)


def test_without_model_the_servers_own_name_is_sent(instant_stub, tiny_llama_dir, tmp_path, capsys):
    """No --model: the name /v1/models lists (a fixed default ran against a server serving another
    name, every request failing with model_not_found); several models: refused, naming them."""
    out = tmp_path / "r.json"
    argv = ["bench", "serve", "--tokenizer", tiny_llama_dir, "--num-prompts", "2", "--input-len", "8",
            "--output-len", "4", "--disable-tqdm"]  # fmt: skip
    assert kvserve_main([*argv, "--base-url", f"{instant_stub.url}/v1", "--save-result", str(out)]) == 0
    assert json.loads(out.read_text())["model"] == "stub-model"
    assert (
        kvserve_main([*argv, "--base-url", f"{instant_stub.url}/aliases/v1", "--save-result", str(out)]) == 0
    )
    assert json.loads(out.read_text())["model"] == "first"  # two names of one model: its first
    assert kvserve_main([*argv, "--base-url", f"{instant_stub.url}/several/v1"]) == 2
    err = capsys.readouterr().err
    assert "error: model: " in err and "serves several models ('a', 'b'); pass --model NAME" in err
    assert kvserve_main([*argv, "--base-url", f"http://127.0.0.1:{free_port()}"]) == 2
    assert "could not be asked which model it serves" in capsys.readouterr().err


def test_the_result_has_vllm_s_flat_keys(instant_stub, tiny_llama_dir, tmp_path):
    """Scripts written against vLLM's benchmark_serving.py read `request_throughput`,
    `mean_ttft_ms`, `p99_itl_ms`, ... at the top of the file; kvserve's result nested them only
    under `metrics` (and had no median / std)."""
    out = tmp_path / "r.json"
    argv = ["bench", "serve", "--base-url", instant_stub.url, "--tokenizer", tiny_llama_dir, "--num-prompts",
            "3", "--input-len", "8", "--output-len", "4", "--disable-tqdm", "--save-result", str(out),
            "--save-detailed"]  # fmt: skip
    assert kvserve_main(argv) == 0
    res = json.loads(out.read_text())
    m = res["metrics"]
    assert (res["completed"], res["failed"], res["num_prompts"]) == (3, 0, 3)
    assert res["duration"] == m["duration_s"]
    assert (res["request_rate"], res["max_concurrency"], res["model_id"]) == ("inf", None, "stub-model")
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "total_output_tokens"):
        assert res[key] == m[key], key
    assert res["request_goodput"] is None  # no --slo
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert res[f"mean_{name}_ms"] == pytest.approx(m[f"{name}_ms"]["mean"])
        assert res[f"p99_{name}_ms"] == pytest.approx(m[f"{name}_ms"]["p99"])
        assert res[f"median_{name}_ms"] == pytest.approx(m[f"{name}_ms"]["p50"])
        assert res[f"std_{name}_ms"] >= 0
    assert res["input_lens"] == [r["prompt_len"] for r in res["requests"]] and len(res["ttfts"]) == 3
    assert res["output_lens"] == [4, 4, 4] and res["errors"] == ["", "", ""]


def test_percentile_metrics_and_metric_percentiles_pick_the_flat_keys(
    instant_stub, tiny_llama_dir, tmp_path, capsys
):
    """vLLM's --percentile-metrics ttft,e2el --metric-percentiles 90,99.9 were "unrecognized
    arguments": the result carries only those latencies' keys, at those percentiles, named as
    vLLM names them (p99.9_ttft_ms), and the table prints them."""
    out = tmp_path / "r.json"
    argv = ["bench", "serve", "--base-url", instant_stub.url, "--tokenizer", tiny_llama_dir, "--num-prompts",
            "3", "--input-len", "8", "--output-len", "4", "--disable-tqdm", "--save-result", str(out),
            "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "90,99.9"]  # fmt: skip
    assert kvserve_main(argv) == 0
    res = json.loads(out.read_text())
    flat = sorted(k for k in res if re.fullmatch(r"(mean|median|std|p[0-9.]+)_[a-z0-9]+_ms", k))
    assert flat == sorted(
        f"{s}_{n}_ms" for s in ("mean", "median", "std", "p90", "p99.9") for n in ("ttft", "e2el")
    )
    assert res["p90_ttft_ms"] == pytest.approx(res["metrics"]["ttft_ms"]["p90"])
    assert res["p90_ttft_ms"] <= res["metrics"]["ttft_ms"]["p99"] <= res["p99.9_ttft_ms"] + 1e-9
    assert "P99.9 TTFT (ms):" in capsys.readouterr().out
    for flag, value, message in [
        ("--percentile-metrics", "ttft,ttfb", "'ttfb' is not one of ttft, tpot, itl, e2el"),
        ("--metric-percentiles", "50,0", "each must be in (0, 100], got '0'"),
        ("--metric-percentiles", "p99", "'p99' is not a number"),
    ]:
        with pytest.raises(SystemExit):
            kvserve_main([*argv[:4], flag, value])
        assert f"argument {flag}: {message}" in capsys.readouterr().err


def test_a_vllm_bench_serve_command_runs_as_written(
    instant_stub, tiny_llama_dir, tmp_path, monkeypatch, capsys
):
    """vLLM's spellings were "unrecognized arguments" (--host/--port, --dataset-name,
    --random-input-len, --backend, --result-dir, --result-filename), "invalid choice" (--endpoint
    /v1/chat/completions) or "expected one argument" (--save-result as a switch)."""
    port = instant_stub.url.rsplit(":", 1)[1]
    argv = ["bench", "serve", "--host", "127.0.0.1", "--port", port, "--tokenizer", tiny_llama_dir,
            "--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "4",
            "--random-range-ratio", "0", "--num-prompts", "2", "--disable-tqdm"]  # fmt: skip
    assert kvserve_main([*argv, "--backend", "openai-chat", "--save-result", "--result-dir", str(tmp_path),
                         "--result-filename", "r.json"]) == 0  # fmt: skip
    res = json.loads((tmp_path / "r.json").read_text())
    assert (res["base_url"], res["endpoint"]) == (instant_stub.url, "chat")
    assert (res["dataset"]["input_len"], res["dataset"]["output_len"], res["completed"]) == (8, 4, 2)
    monkeypatch.chdir(tmp_path)  # --save-result alone: a file named from the run, as vLLM's
    assert (
        kvserve_main([*argv, "--endpoint", "/v1/completions", "--save-result", "--max-concurrency", "2"]) == 0
    )
    (named,) = tmp_path.glob("openai-infqps-concurrency2-stub-model-*.json")
    assert json.loads(named.read_text())["endpoint"] == "completions"
    capsys.readouterr()
    for extra, message in [
        (["--result-filename", "x.json"], "result-filename: needs --save-result"),
        (["--base-url", instant_stub.url], "base-url: give --base-url or --host / --port, not both"),
        (["--backend", "vllm", "--endpoint", "chat"], "backend: --backend vllm is --endpoint completions"),
    ]:
        assert kvserve_main([*argv, *extra]) == 2
        assert capsys.readouterr().err.startswith(f"error: {message}")


def test_more_of_vllm_s_bench_serve_flags_run_as_written(instant_stub, tiny_llama_dir, tmp_path, capsys):
    """--goodput ttft:MS (vLLM's --slo), --num-warmups, --metadata KEY=VALUE, --served-model-name
    (the name sent, --model then the tokenizer) and --trust-remote-code were "unrecognized
    arguments"."""
    out = tmp_path / "r.json"
    argv = ["bench", "serve", "--base-url", instant_stub.url, "--model", tiny_llama_dir, "--num-prompts", "2",
            "--input-len", "8", "--output-len", "4", "--disable-tqdm", "--trust-remote-code",
            "--served-model-name", "stub-model", "--save-result", str(out)]  # fmt: skip
    extra = [
        "--goodput",
        "ttft:60000",
        "e2el:60000",
        "--num-warmups",
        "1",
        "--metadata",
        "version=1.2",
        "tp=1",
    ]
    assert kvserve_main([*argv, *extra]) == 0
    res = json.loads(out.read_text())
    assert res["metrics"]["slo_ms"] == {"ttft": 60000.0, "e2el": 60000.0} and res["request_goodput"] > 0
    assert (res["load"]["warmup"], res["version"], res["tp"]) == (1, "1.2", "1")
    assert (res["model"], res["completed"]) == ("stub-model", 2)
    capsys.readouterr()
    for bad, message in [
        (["--goodput", "ttft:500", "--slo", "ttft:500"], "goodput: give --slo or --goodput"),
        (["--goodput", "ttfb:5"], "goodput: 'ttfb:5' must be KEY:MS"),
        (["--num-warmups", "2", "--warmup", "1"], "num-warmups: give --warmup or --num-warmups"),
    ]:
        assert kvserve_main([*argv, *bad]) == 2
        assert capsys.readouterr().err.startswith(f"error: {message}")
    with pytest.raises(SystemExit):
        kvserve_main([*argv, "--metadata", "novalue"])
    assert "argument --metadata: 'novalue' must be KEY=VALUE" in capsys.readouterr().err


def test_save_detailed_without_save_result_is_refused(capsys):
    """--save-detailed alone ran the benchmark and wrote the per-request timings nowhere."""
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:1", "--model", "tiny", "--save-detailed"]
    assert kvserve_main(argv) == 2
    assert "error: save-detailed: needs --save-result" in capsys.readouterr().err


def test_trace_dataset_replays_arrivals(instant_stub, tiny_tok, tmp_path):
    """--dataset trace: the planner's trace format, each line once at its time, lengths as given."""
    path = tmp_path / "t.jsonl"
    rows = [
        {"t": 0.5, "prompt_tokens": 12, "output_tokens": 3},
        {"t": 0.7, "prompt_tokens": 30, "output_tokens": 5},
        {"t": 1.2, "prompt_tokens": 8, "output_tokens": 2},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reqs = build_dataset(tiny_tok, DatasetConfig("trace", num_prompts=1, path=str(path)))
    assert [r.arrival_s for r in reqs] == [0.5, 0.7, 1.2] and [r.output_len for r in reqs] == [3, 5, 2]
    for r, row in zip(reqs, rows):  # the toy vocabulary's tokens may merge when re-encoded
        assert abs(r.prompt_len - row["prompt_tokens"]) <= row["prompt_tokens"] // 2
    cfg = LoadConfig(instant_stub.url, "stub", progress=False)
    assert schedule(reqs, cfg) == pytest.approx([0.0, 0.2, 0.5])
    results, _ = _run(cfg, reqs)
    starts = [r.start for r in results]
    assert all(_sent_on_time(s, t) for s, t in zip(starts, [0.0, 0.2, 0.7])), starts
    assert len(build_dataset(tiny_tok, DatasetConfig("trace", path="bursty:duration=20,seed=1"))) > 5
    with pytest.raises(ValueError, match="dataset-path"):
        build_dataset(tiny_tok, DatasetConfig("trace"))


# ---- the CLI: sweep + plot, serve JSON -----------------------------------------------------------


def test_sweep_plots_one_line_per_server(timed_stub, instant_stub, tiny_llama_dir, tmp_path):
    png, js = tmp_path / "sweep.png", tmp_path / "sweep.json"
    rc = kvserve_main([
        "bench", "sweep", "--base-url", timed_stub.url, "--base-url", instant_stub.url, "--label", "timed",
        "--label", "instant", "--concurrencies", "1,4", "--model", "stub", "--tokenizer", tiny_llama_dir,
        "--num-prompts", "4", "--output-len", "10", "--input-len", "8", "--plot", str(png),
        "--save-result", str(js), "--disable-tqdm",
    ])  # fmt: skip
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    res = json.loads(js.read_text())
    assert [s["label"] for s in res["series"]] == ["timed", "instant"]
    timed = res["series"][0]["runs"]
    assert [r["max_concurrency"] for r in timed] == [1, 4]
    one, four = (r["metrics"]["output_throughput"] for r in timed)
    # 4 streams at once: 4x the tokens in the same time (a loaded host loses some of it; one at a
    # time, as a sweep that ignored its concurrency would run, gives 1x)
    assert 2.5 <= four / one <= 4.2, four / one


# ---- against real servers ---------------------------------------------------------------------


def _bench_serve(url: str, model: str | None, tmp_path, *extra: str) -> dict:
    """model None: no --model (the server's own name is sent)."""
    out = tmp_path / "r.json"
    named = ["--model", model] if model else []
    rc = kvserve_main([
        "bench", "serve", "--base-url", url, *named, "--num-prompts", "4", "--input-len", "16",
        "--output-len", "8", "--ignore-eos", "--max-concurrency", "2", "--disable-tqdm",
        "--save-result", str(out), *extra,
    ])  # fmt: skip
    res = json.loads(out.read_text())
    assert rc == 0, res["metrics"].get("errors")
    return res


@pytest.mark.parametrize("engine", ["kvserve", "naive"])
def test_bench_against_real_server(engine, tiny_llama_dir, tiny_tok, tmp_path):
    server = ServerProcess(
        tiny_llama_dir,
        "--engine",
        engine,
        *(["--kv-cache-memory", "64MiB"] if engine == "kvserve" else []),  # naive refuses engine flags
        api_key=None,
        log_path="/tmp/srvt.log",
    )
    try:
        res = _bench_serve(server.url, tiny_llama_dir, tmp_path, "--warmup", "1")
        m = res["metrics"]
        prompts = _requests(tiny_tok, 4, 8)
        assert (m["completed"], m["failed"], m["total_output_tokens"]) == (4, 0, 32)
        assert m["total_input_tokens"] == sum(r.prompt_len for r in prompts)  # server agrees on length
        assert 0 < m["ttft_ms"]["p50"] <= m["e2el_ms"]["p50"] and m["output_throughput"] > 0
        assert res["load"]["max_concurrency"] == 2 and res["dataset"]["name"] == "random"
        chat = _bench_serve(server.url, None, tmp_path, "--endpoint", "chat", "--dataset", "chat")
        assert chat["metrics"]["completed"] == 4 and chat["metrics"]["total_output_tokens"] > 0
        assert chat["model"] == httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        ids = _bench_serve(server.url, tiny_llama_dir, tmp_path, "--prompt-format", "ids")
        assert ids["metrics"]["total_input_tokens"] == m["total_input_tokens"]
        if engine == "kvserve":  # the end-of-sequence token first: an answer with no text, not a failure
            eos_first = LoadConfig(
                server.url, tiny_llama_dir, extra_body={"logit_bias": {"2": 100}}, progress=False
            )
            empty, _ = _run(eos_first, prompts[:2])
            assert [(r.success, r.text, r.output_tokens) for r in empty] == [(True, "", 1)] * 2, empty[
                0
            ].error
            assert all(0 < r.ttft <= r.latency for r in empty)
        # a refused request comes back as a failed result naming the server's answer
        refused, _ = _run(LoadConfig(server.url, "no-such-model", progress=False), prompts[:2])
        assert [r.success for r in refused] == [False, False]
        status = "HTTP 404" if engine == "kvserve" else "HTTP 400"  # the naive baseline says 400
        assert all(r.error.startswith(status) and "model" in r.error for r in refused), refused[0].error
    finally:
        server.stop()


def test_unreachable_server_fails_each_request(tiny_tok):
    cfg = LoadConfig(f"http://127.0.0.1:{free_port()}", "m", progress=False)
    results, _ = _run(cfg, _requests(tiny_tok, 2, 4))
    assert [r.success for r in results] == [False, False]
    assert all("Connect" in r.error for r in results), [r.error for r in results]


def test_naive_server_api(tiny_llama_dir, tiny_tok):
    """The baseline speaks the same API: non-streaming, models, errors, greedy = streamed text;
    it renders chats with --chat-template (which it ignored, using the model's own)."""
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}ANSWER:"
    server = ServerProcess(
        tiny_llama_dir, "--engine", "naive", "--served-model-name", "tiny", "--chat-template", template,
        api_key=None,
    )  # fmt: skip
    try:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(
            tiny_tok.encode("[user] hi\nANSWER:", add_special_tokens=False)
        )
        body = {
            "model": "tiny",
            "prompt": "Hello world",
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
        assert r["usage"]["completion_tokens"] == 6 and r["choices"][0]["finish_reason"] == "length"
        streamed = ""
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30
        ) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    streamed += json.loads(line[6:])["choices"][0]["text"]
        assert streamed == r["choices"][0]["text"]
        # the same weights give kvserve's greedy text
        ours = LLM(tiny_llama_dir, kv_cache_memory="16MiB").generate(
            [body["prompt"]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        )
        assert r["choices"][0]["text"] == ours[0].outputs[0].text
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "tiny"
        bad = httpx.post(f"{server.url}/v1/completions", json={**body, "model": "other"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"
        assert httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 0}).status_code == 400
    finally:
        server.stop()


def test_bench_offline(tiny_llama_dir, tmp_path):
    out = tmp_path / "off.json"
    rc = kvserve_main([
        "bench", "offline", "--model", tiny_llama_dir, "--kv-cache-memory", "64MiB", "--num-prompts", "4",
        "--input-len", "16", "--output-len", "8", "--ignore-eos", "--save-result", str(out),
    ])  # fmt: skip
    res = json.loads(out.read_text())
    m = res["metrics"]
    assert rc == 0 and (m["completed"], m["total_output_tokens"]) == (4, 32)
    # the engine settings the numbers came from (defaults resolved) are in the file
    assert res["engine"] == {"kv_cache_memory": "64MiB", "max_num_seqs": 128, "max_num_batched_tokens": 512,
                             "dtype": "float32", "ignore_eos": True, "temperature": 0.0}  # fmt: skip
    assert m["output_throughput"] > 0 and m["ttft_ms"]["mean"] > 0


def test_ctrl_c_reports_what_finished_and_exits_130(timed_stub, tiny_llama_dir, tmp_path):
    """Ctrl-C in `bench serve` was a KeyboardInterrupt traceback that lost every result of the
    run; now the requests that finished are reported and saved, the rest counted as interrupted
    (not as the server's failures), and the exit status is 130."""
    import signal
    import threading

    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "bench", "serve", "--base-url", timed_stub.url,
           "--model", "stub", "--tokenizer", tiny_llama_dir, "--num-prompts", "30", "--max-concurrency", "1",
           "--input-len", "8", "--output-len", "50", "--save-result", str(out)]  # fmt: skip
    table = tmp_path / "table.txt"
    with open(table, "wb") as stdout:
        # SIGINT as a terminal gives it: a suite started in the background (`make test &`)
        # passes its children SIGINT ignored, and the run went on to its end with status 0.
        proc = subprocess.Popen(
            cmd, env=env, stdout=stdout, stderr=subprocess.PIPE,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
    # tqdm's bar: "1/30" once the first request (200 + 49 * 20 ms) finished; 30 (~35 s) leave the
    # signal a run to land in however late the bar is read.
    err = bytearray()
    reader = threading.Thread(target=lambda: [err.extend(b) for b in iter(lambda: proc.stderr.read(1), b"")])
    reader.start()
    deadline = time.monotonic() + 60
    while b"1/30" not in err and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    proc.wait(60)
    reader.join(10)
    said = err.decode(errors="replace")
    assert proc.returncode == 130, said
    assert "Traceback" not in said and "interrupted (Ctrl-C): " in said
    m = json.loads(out.read_text())["metrics"]
    assert m["completed"] >= 1 and m["failed"] == 0 and m["completed"] + m["interrupted"] == 30, m
    assert "errors" not in m and m["total_output_tokens"] == 50 * m["completed"]
    assert "Interrupted requests (Ctrl-C):" in table.read_text()


def test_a_server_wanting_a_key_is_said_to_want_one(instant_stub, tiny_llama_dir, capsys):
    """No --model against a server that answers 401: the message said "pass --model NAME", after
    which every request failed with the same 401."""
    argv = ["bench", "serve", "--tokenizer", tiny_llama_dir, "--num-prompts", "1", "--disable-tqdm"]
    assert kvserve_main([*argv, "--base-url", f"{instant_stub.url}/locked/v1"]) == 2
    err = capsys.readouterr().err
    assert (
        "error: api-key: " in err
        and "answered HTTP 401" in err
        and err.rstrip().endswith("pass --api-key KEY")
    )
    assert kvserve_main([*argv, "--base-url", f"{instant_stub.url}/locked/v1", "--api-key", "k"]) == 2
    assert capsys.readouterr().err.rstrip().endswith("pass the right --api-key")


def test_stream_events_that_are_no_openai_objects_fail_the_request_not_the_run(
    instant_stub, tiny_llama_dir, tmp_path, capsys
):
    """`data: [1, 2]` was an AttributeError traceback that ended the whole run."""
    out = tmp_path / "r.json"
    argv = ["bench", "serve", "--base-url", f"{instant_stub.url}/garbled/v1", "--model", "stub",
            "--tokenizer", tiny_llama_dir, "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
            "--disable-tqdm", "--save-result", str(out)]  # fmt: skip
    assert kvserve_main(argv) == 1
    m = json.loads(out.read_text())["metrics"]
    assert (m["completed"], m["failed"], m["errors"]) == (0, 2, ["not an OpenAI stream event: [1, 2]"])
    assert "Traceback" not in capsys.readouterr().err


def test_an_answer_that_is_no_event_stream_is_said_to_be_one(instant_stub, tiny_llama_dir, tmp_path):
    """A server ignoring stream: true (or a web page at the URL) was "no text was streamed",
    saying nothing of what came instead."""
    out = tmp_path / "r.json"
    argv = ["bench", "serve", "--base-url", f"{instant_stub.url}/plain/v1", "--model", "stub",
            "--tokenizer", tiny_llama_dir, "--num-prompts", "1", "--input-len", "8", "--output-len", "4",
            "--disable-tqdm", "--save-result", str(out)]  # fmt: skip
    assert kvserve_main(argv) == 1
    assert json.loads(out.read_text())["metrics"]["errors"] == [
        "no text was streamed (the answer was no event stream: application/json: "
        '\'{"id":"cmpl-plain","choices":[]}\')'
    ]
