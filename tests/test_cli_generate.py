"""`kvserve generate`'s argument errors come before the model loads."""

from __future__ import annotations

import pytest

from kvserve.entrypoints.cli import main


def test_an_empty_prompt_is_refused_before_the_model_loads(tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")  # loading it would fail with another message
    assert main(["generate", "", "--model", missing]) == 2
    assert "error: prompt: give a prompt" in capsys.readouterr().err


def test_a_non_finite_temperature_is_refused_as_the_http_api_does(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "Hi", "--temperature", "inf"])
    assert e.value.code == 2
    assert "error: argument --temperature: must be a finite number, got 'inf'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["Hi", "--system", "Be brief."], "error: system: --system is for --chat"),  # was dropped unsaid
        (["Hi", "--chat"], "error: prompt: --chat reads the conversation from stdin"),  # likewise the prompt
    ],
)
def test_options_of_the_other_mode_are_refused_before_the_model_loads(args, message, tmp_path, capsys):
    assert main(["generate", *args, "--model", str(tmp_path / "no-such-model")]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value, message",
    [
        # each was refused only after the model had loaded (past its vocabulary / context)
        ("--top-k", str(10**23), "must be <= 1,048,576 (past any model's vocabulary), got " + str(10**23)),
        (
            "--max-tokens",
            str(10**21),
            "must be <= 100,000,000 (past any model's context), got " + str(10**21),
        ),
        ("--top-k", "-2", "must be >= -1, got -2"),
        ("--top-k", "1e23", "must be an integer, got '1e23'"),
        ("--max-tokens", "0", "must be >= 1, got 0"),
    ],
)
def test_sampling_values_past_any_model_are_refused_at_parse(flag, value, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "Hi", flag, value])
    assert e.value.code == 2 and f"argument {flag}: {message}" in capsys.readouterr().err


def test_top_k_minus_one_and_a_vocabulary_sized_one_still_parse():
    from kvserve.entrypoints.cli import build_parser

    args = build_parser().parse_args(["generate", "Hi", "--top-k", "-1", "--max-tokens", "8192"])
    assert (args.top_k, args.max_tokens) == (-1, 8192)
    assert build_parser().parse_args(["generate", "Hi", "--top-k", "262144"]).top_k == 262144
