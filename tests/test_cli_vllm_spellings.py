"""Engine flags as vLLM scripts spell them: `--max-model-len 4k` / `-1` / `auto` and `--dtype auto`
were refused by `kvserve serve`, `generate`, `run-batch`, `eval` and `plan` ("invalid int
value: '4k'", "must be >= 1, got -1", "'auto' is not one of ..."), while LLM(dtype="auto") took
vLLM's default. Parsing only: no model loads."""

from __future__ import annotations

import json

import pytest

from kvserve.entrypoints.cli import build_parser, engine_config


def _config(*flags: str):
    return engine_config(build_parser().parse_args(["serve", *flags]))


@pytest.mark.parametrize(
    "value, tokens",
    [
        ("4096", 4096),
        ("4k", 4000),
        ("4K", 4096),
        ("25.6k", 25600),
        ("1M", 2**20),
        ("-1", None),
        ("auto", None),
    ],
)
def test_max_model_len_takes_vllm_s_spellings(value, tokens):
    assert _config("--max-model-len", value).max_model_len == tokens


@pytest.mark.parametrize(
    "value, message",
    [
        ("4.5K", "must be a number of tokens (4096, 4k = 4,000, 4K = 4,096), got '4.5K'"),
        ("1.0005k", "must be a whole number of tokens, got '1.0005k'"),
        ("0", "must be >= 1, got 0"),
        ("-2", "must be >= 1, got -2"),
    ],
)
def test_max_model_len_refuses_what_is_no_token_count_naming_the_flag(value, message, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["generate", "Hi", "--max-model-len", value])
    assert e.value.code == 2 and f"argument --max-model-len: {message}" in capsys.readouterr().err


def test_dtype_auto_is_the_default_dtype_as_llm_takes_it():
    assert _config("--dtype", "auto").dtype == _config().dtype == "float32"
    assert _config("--dtype", "bf16").dtype == "bf16"


def test_plan_takes_the_same_spellings(capsys):
    from kvserve.planner.cli import main

    assert main(["Llama-3.1-8B", "--max-model-len", "8K", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["max_model_len"] == 8192
    assert main(["Llama-3.1-8B", "--max-model-len", "auto", "--json"]) == 0  # the model's context
    assert json.loads(capsys.readouterr().out)["settings"]["max_model_len"] == 131072


def test_serve_takes_vllm_s_model_flag(tmp_path, capsys):
    """`kvserve serve --model PATH`, as vLLM's scripts start its server, was "unrecognized
    arguments: --model"; it names the model (a missing one is said to be missing)."""
    from kvserve.entrypoints.cli import main

    missing = str(tmp_path / "no-model")
    assert main(["serve", "--model", missing, "--port", "0"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"error: model: {missing!r} not found")
    assert main(["serve", "other.gguf", "--model", missing]) == 2
    assert (
        capsys.readouterr().err
        == f"error: model: given twice, 'other.gguf' and --model {missing!r}; give one\n"
    )


def test_serve_takes_vllm_s_short_parallel_and_quantization_flags():
    """`vllm serve MODEL -tp 2` (and -pp, -dp, -q) was "unrecognized arguments: -tp 2"."""
    config = _config("-tp", "2", "-dp", "1", "-q", "int8")
    assert (config.tensor_parallel_size, config.data_parallel_size, config.quantization) == (2, 1, "int8")
    assert _config("-pp", "2").pipeline_parallel_size == 2
    assert build_parser().parse_args(["generate", "Hi", "-tp", "2"]).tensor_parallel_size == 2


def test_plan_takes_dtype_auto_as_its_default(capsys):
    """`kvserve plan MODEL --dtype auto` was "invalid choice: 'auto'"."""
    from kvserve.planner.cli import main

    assert main(["Llama-3.1-8B", "--dtype", "auto", "--json"]) == 0
    auto = json.loads(capsys.readouterr().out)
    assert main(["Llama-3.1-8B", "--json"]) == 0
    assert auto == json.loads(capsys.readouterr().out) and auto["settings"]["compute_dtype"] == "bf16"


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_kv_cache_dtype_fp8_is_vllm_s_name_for_e4m3(command, capsys):
    """`--kv-cache-dtype fp8`, vLLM's usual spelling, was refused ("'fp8' is not one of auto,
    fp8_e4m3, int8") once serve's engine processes had started; fp8_e5m2 likewise. Now fp8 is
    fp8_e4m3 (so is LLM(kv_cache_dtype="fp8")), and another name is refused at parse."""
    from kvserve.entrypoints.llm_options import engine_options

    parse = build_parser().parse_args
    assert engine_config(parse([command, "--kv-cache-dtype", "fp8"])).kv_cache_dtype == "fp8_e4m3"
    assert engine_config(parse([command, "--kv-cache-dtype", "int8"])).kv_cache_dtype == "int8"
    assert engine_options("m", {"kv_cache_dtype": "fp8"}) == {"kv_cache_dtype": "fp8_e4m3"}
    with pytest.raises(SystemExit):
        parse([command, "--kv-cache-dtype", "fp8_e5m2"])
    assert (
        "argument --kv-cache-dtype: 'fp8_e5m2' is not one of auto, fp8_e4m3, int8" in capsys.readouterr().err
    )


@pytest.mark.parametrize("command", [["serve"], ["generate", "Hi"], ["run-batch", "-i", "{f}", "-o", "{o}"]])
def test_dtype_takes_vllm_s_float_and_refuses_half_at_parse(command, tmp_path, capsys):
    """`--dtype float` (vLLM's float32) and `--dtype half` were refused only once serve's engine
    processes had started; float is now float32, half / float16 refused while parsing."""
    (tmp_path / "in.jsonl").write_text("\n")
    argv = [a.format(f=tmp_path / "in.jsonl", o=tmp_path / "out.jsonl") for a in command]
    assert build_parser().parse_args([*argv, "--dtype", "float"]).dtype == "float32"
    assert build_parser().parse_args([*argv, "--dtype", "BF16"]).dtype == "bf16"
    for value in ("half", "float16"):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args([*argv, "--dtype", value])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"argument --dtype: '{value}': float16 (half) is not supported" in err


def test_llm_takes_the_same_dtype_spellings():
    """LLM(dtype="float") / torch.float32 were a ValueError; half is refused naming dtype."""
    import torch

    from kvserve.entrypoints.llm_options import engine_options

    assert engine_options("m", {"dtype": "float"}) == {"dtype": "float32"}
    assert engine_options("m", {"dtype": torch.bfloat16}) == {"dtype": "bfloat16"}
    with pytest.raises(ValueError, match=r"^dtype: 'float16': float16 \(half\) is not supported"):
        engine_options("m", {"dtype": torch.float16})
