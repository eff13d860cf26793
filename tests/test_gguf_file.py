"""An engine's start parses the default model's GGUF metadata once (architecture, tokenizer and
weights share one reader), and the reader is dropped once the weights are loaded."""

from __future__ import annotations

import os

import gguf
import numpy as np
import torch

from kvserve.model.loader import gguf_file, load_arch, load_tokenizer, load_weights_only, resolve_model


def test_one_parse_per_load_then_released(monkeypatch):
    parses = []
    real = gguf.GGUFReader.__init__

    def counting(self, path, *args, **kwargs):
        parses.append(path)
        real(self, path, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counting)
    source = resolve_model("smollm2-135m")
    gguf_file.release_gguf_reader(source.path)  # whatever an earlier test left
    arch = load_arch(source)
    tok = load_tokenizer(source)
    model = load_weights_only(source, torch.float32, torch.device("cpu"), "int4")
    assert len(parses) == 1
    assert model.arch == arch and tok.encode("hello")
    assert not _cached(source.path)  # the next load parses again


def _cached(path: str) -> bool:
    return any(key[0] == os.path.realpath(path) for key in gguf_file._readers)


def _write(path: str, name: str) -> None:
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(name)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


def test_a_rewritten_file_is_parsed_again(tmp_path):
    path = str(tmp_path / "m.gguf")
    _write(path, "first")
    first = gguf_file.gguf_reader(path)
    assert gguf_file.gguf_reader(path) is first
    _write(path, "second, longer")  # another size: another file as far as the cache knows
    again = gguf_file.gguf_reader(path)
    assert again is not first and again.fields["general.name"].contents() == "second, longer"
    gguf_file.release_gguf_reader(path)
    assert not _cached(path)


def test_at_most_two_readers_oldest_dropped_first(tmp_path):
    paths = [str(tmp_path / f"m{i}.gguf") for i in range(3)]
    for i, path in enumerate(paths):
        _write(path, f"model {i}")
        gguf_file.gguf_reader(path)
    assert [_cached(p) for p in paths] == [False, True, True]
    for path in paths:
        gguf_file.release_gguf_reader(path)


def test_the_reader_gives_gguf_s_own_fields_and_tensors(tmp_path):
    """The plain-view reader (a faster parse) reads what `gguf.GGUFReader` reads: every field's
    parts and every tensor's name, type, shape and bytes, strings and string arrays included."""
    path = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("plain views")
    w.add_token_list(["<s>", "hello", "wörld", ""])
    w.add_array("test.floats", [0.5, -2.0])
    w.add_token_types([1, 3, 6, 1])
    w.add_token_scores([0.0, -1.5, -2.5, 0.25])
    w.add_array("test.empty", [])
    w.add_array("test.flags", [True, False])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_tensor("a.weight", np.arange(48, dtype=np.float32).reshape(6, 8))
    w.add_tensor("b.weight", np.arange(64, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = gguf_file.gguf_reader(path), gguf.GGUFReader(path)
    gguf_file.release_gguf_reader(path)
    assert type(ours) is not gguf.GGUFReader and list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.types, mine.data) == (field.types, field.data), name
        assert [bytes(p) for p in mine.parts] == [bytes(p) for p in field.parts], name
    assert ours.fields["tokenizer.ggml.tokens"].contents() == ["<s>", "hello", "wörld", ""]
    assert len(ours.tensors) == len(theirs.tensors) == 2
    for mine, t in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.tensor_type, list(mine.shape)) == (t.name, t.tensor_type, list(t.shape))
        assert np.array_equal(mine.data, t.data) and mine.data.dtype == t.data.dtype


def _weighted(path: str) -> None:
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("weights")
    w.add_tensor("a.weight", np.arange(4096, dtype=np.float32).reshape(64, 64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_file_that_is_no_complete_gguf_is_named_with_what_it_is(tmp_path):
    """A Git LFS pointer (a clone without git-lfs), an empty file, another format and a cut-off
    download each stopped the load with numpy's words ("GGUF magic invalid", "cannot mmap an
    empty file", "cannot reshape array ...") and no file named."""
    lfs = tmp_path / "lfs.gguf"
    lfs.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:4d7e\nsize 98362432\n")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(100))
    whole, cut = str(tmp_path / "whole.gguf"), tmp_path / "cut.gguf"
    _weighted(whole)
    with open(whole, "rb") as f:
        cut.write_bytes(f.read()[: os.path.getsize(whole) - 1000])
    expected = {
        lfs: "is a Git LFS pointer, not the file itself: fetch it with `git lfs pull`",
        empty: "is empty (0 bytes), not a GGUF file",
        other: "is not a GGUF file (it starts with b'PK\\x03\\x04', not b'GGUF')",
        cut: "is not a complete GGUF file (",
    }
    for path, why in expected.items():
        try:
            gguf_file.gguf_reader(str(path))
        except ValueError as e:
            assert str(e).startswith(f"model: {str(path)!r} {why}"), str(e)
        else:
            raise AssertionError(f"{path.name} was read")
        assert not _cached(str(path))
    assert len(gguf_file.gguf_reader(whole).tensors) == 1
    gguf_file.release_gguf_reader(whole)
