"""`kvserve eval perplexity`'s argument errors stop it before the model loads and the run starts."""

from __future__ import annotations

import pytest

from kvserve.entrypoints.cli import main


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-tokens", "-5"], "argument --max-tokens: must be >= 1, got -5"),  # ran the whole corpus
        (["--corpus", "{tmp}"], "argument --corpus: '{tmp}': is a directory"),  # IsADirectoryError
        (["--json", "{tmp}/no-dir/x.json"], "argument --json: '{tmp}/no-dir/x.json': no such directory"),
        # a bare codec error naming no flag, after the model had loaded
        (
            ["--corpus", "{tmp}/latin1.txt"],
            "argument --corpus: '{tmp}/latin1.txt': not UTF-8 text (byte 0xe9 at offset 3)",
        ),
    ],
)
def test_bad_arguments_name_the_flag_before_the_model_loads(args, message, tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")  # loading it would fail with another message
    (tmp_path / "latin1.txt").write_bytes("café au lait".encode("latin-1"))
    with pytest.raises(SystemExit) as e:
        main(["eval", "perplexity", missing, *(a.format(tmp=tmp_path) for a in args)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error: " + message.format(tmp=tmp_path) in err and "Traceback" not in err
