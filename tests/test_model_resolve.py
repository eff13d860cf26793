"""What `model` names when it is no model kvserve can load: the message says what is there."""

from __future__ import annotations

import pytest

from kvserve.model.loader import resolve_model


def test_a_file_of_another_format_is_said_to_be_one_not_missing(tmp_path):
    """`kvserve serve ./model.safetensors` said the file was not found."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(FileNotFoundError) as e:
        resolve_model(str(weights))
    said = str(e.value)
    assert said.startswith(f"model: {str(weights)!r} is a file but not a .gguf; pass a .gguf file, or")
    assert "not found" not in said


def test_a_folder_of_several_ggufs_names_them(tmp_path):
    """A folder holding several quantizations was said to hold no single .gguf file."""
    for name in ("m.Q8_0.gguf", "m.Q4_K_M.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError) as e:
        resolve_model(str(tmp_path))
    assert str(e.value) == (
        f"model: {str(tmp_path)!r} holds 2 .gguf files (m.Q4_K_M.gguf, m.Q8_0.gguf) and no config.json; "
        "pass one of them"
    )
    (tmp_path / "m.Q8_0.gguf").unlink()
    assert resolve_model(str(tmp_path)).path == str(tmp_path / "m.Q4_K_M.gguf")


@pytest.mark.parametrize(
    "config, message",
    [
        (
            '{"model_type": "llama", "hidden_size": 64}',
            "has no num_attention_heads, part of the model's shape",
        ),
        ("not json", "is not JSON (Expecting value: line 1 column 1 (char 0))"),
        ("[1]", "is not a JSON object"),
    ],
)
def test_a_config_json_the_model_cannot_be_built_from_is_named(config, message, tmp_path):
    """`kvserve serve DIR` on a config.json lacking a field was a KeyError traceback."""
    from kvserve.model.loader import load_arch

    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ValueError) as e:
        load_arch(resolve_model(str(tmp_path)))
    assert str(e.value) == f"model: {str(tmp_path / 'config.json')!r} {message}"
