"""`kvserve eval perplexity`'s argument errors stop it before the model loads and the run starts."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvserve.entrypoints.cli import main


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-tokens", "-5"], "argument --max-tokens: must be >= 2, got -5"),  # ran the whole corpus
        (["--window", "1"], "argument --window: must be >= 2, got 1"),  # once found after the model loaded
        (["--window", "0"], "argument --window: must be >= 2, got 0"),  # said ">= 1", not its bound
        # these two were "token_ids: need at least 2 tokens to score", after the model had loaded
        (["--max-tokens", "1"], "argument --max-tokens: must be >= 2, got 1"),
        # 20 digits were taken (a typo for a corpus length, or a window cut to the model's unsaid)
        (["--window", "12345678901234567890"], "argument --window: must be <= 10,000,000 (past any model's"),
        (["--max-tokens", "12345678901234567890"], "argument --max-tokens: must be <= 1,000,000,000 (past"),
        (["--corpus", "{tmp}/blank.txt"], "argument --corpus: '{tmp}/blank.txt': no text to score"),
        # a byte-order mark and a newline (an empty file saved by Windows' Notepad) was scored
        (["--corpus", "{tmp}/bom.txt"], "argument --corpus: '{tmp}/bom.txt': no text to score"),
        (["--corpus", "{tmp}"], "argument --corpus: '{tmp}': is a directory"),  # IsADirectoryError
        (["--corpus", "/dev/null"], "argument --corpus: '/dev/null': not a regular file"),  # "no such file"
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
    (tmp_path / "blank.txt").write_text("\n  \n")
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf\r\n")
    with pytest.raises(SystemExit) as e:
        main(["eval", "perplexity", missing, *(a.format(tmp=tmp_path) for a in args)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error: " + message.format(tmp=tmp_path) in err and "Traceback" not in err


def test_json_records_the_window_and_dtypes_as_run(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    """A window past what the model holds is cut to max_model_len - 1: the JSON and the line
    say so (the JSON had no window at all, so results of different windows looked alike).
    The dtypes are the ones the run used: bfloat16 on a CPU without native bf16 computes in
    float32, and the KV cache's "auto" is that dtype (both were recorded as asked:
    "bfloat16" and "auto")."""
    from kvserve.platform import cpu_isa as isa_mod
    from kvserve.platform.cpu_isa import CpuIsa

    monkeypatch.setattr(isa_mod, "cpu_isa", lambda: CpuIsa(frozenset({"avx2", "fma"})))
    out = tmp_path / "ppl.json"
    args = ["--max-tokens", "40", "--window", "4096", "--kv-cache-memory", "16MiB", "--no-progress"]
    assert main(["eval", "perplexity", tiny_llama_dir, *args, "--dtype", "bfloat16", "--json", str(out)]) == 0
    row = json.loads(out.read_text())
    assert (row["window"], row["windows"], row["tokens"]) == (511, 1, 39)
    assert (row["dtype"], row["kv_cache_dtype"]) == ("float32", "float32")
    printed = capsys.readouterr().out
    assert "windows of 511 (--window 4096 is more than the model holds)" in printed
    assert "dtype float32  quantization none  kv-cache float32" in printed


def test_a_corpus_of_one_token_names_the_file_and_what_it_needs(tiny_llama_dir, tmp_path, capsys):
    """A one-character file passes the check for text but is one token: the run ended with
    "token_ids: need at least 2 tokens to score", naming neither the corpus nor what to do."""
    corpus = tmp_path / "one.txt"
    corpus.write_text("a")
    args = ["--corpus", str(corpus), "--kv-cache-memory", "16MiB", "--no-progress"]
    assert main(["eval", "perplexity", tiny_llama_dir, *args]) == 2
    err = capsys.readouterr().err
    assert (
        f"error: corpus: {str(corpus)!r} is 1 token for this model's tokenizer; perplexity needs at least 2"
        in err
    )
    assert "give a longer text" in err and "Traceback" not in err


def test_a_byte_order_mark_is_not_scored(tiny_llama_dir, tmp_path):
    """A corpus saved with a byte-order mark had it scored as the first tokens of the text."""
    from kvserve.eval.perplexity import load_corpus
    from kvserve.model.loader import load_tokenizer, resolve_model

    engine = SimpleNamespace(tokenizer=load_tokenizer(resolve_model(tiny_llama_dir)))  # all load_corpus reads
    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_text("The quick brown fox jumps over the lazy dog.", encoding="utf-8")
    marked.write_text("The quick brown fox jumps over the lazy dog.", encoding="utf-8-sig")
    assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
    assert load_corpus(engine, str(marked)) == load_corpus(engine, str(plain))
