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
