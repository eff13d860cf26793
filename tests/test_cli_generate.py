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
