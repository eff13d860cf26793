"""One parse of a GGUF file's metadata per model load.

`gguf.GGUFReader` parses every metadata field when it is constructed, the tokenizer's ~100,000
vocabulary and merge strings included, one numpy view each: 5.1 s for the default model on a
2-core AVX2 EPYC. An engine's start used to ask for the file three times (architecture to
size the KV pool, tokenizer, weights). Now the first ask parses it and the others reuse that
reader until the weights have been read from it; then it is dropped, so its memory map does
not outlive the load. A process that never loads the weights (the API server) keeps its
reader, whose map only had its metadata pages touched; at most `MAX_READERS` are kept (a
model and its draft), the oldest dropped first.

The parse itself runs on plain ndarray views of the file's map (`_PlainViewReader`): gguf
slices its map a few times per string, and a `numpy.memmap` slice runs Python code per view
(1.2 million `__array_finalize__` calls for the default model); a plain view does not, which
cuts the parse's CPU time 3.4x (benchmarks/bench_gguf_parse.py: 2.51 s to 0.74 s, round 41).
Arrays (the vocabulary, merges, token types) are then read in one pass each, to the same parts
gguf would make: 0.13 s against gguf's 2.28 (round 50).
"""

from __future__ import annotations

import functools
import os
import sys
import threading

MAX_READERS = 2
_readers: dict[tuple[str, int, int], object] = {}  # in the order they were parsed
_lock = threading.Lock()


@functools.cache
def _reader_class():
    """`gguf.GGUFReader` whose map is read through a plain ndarray view: the same bytes, the
    same fields and tensors (their `.data` are plain ndarrays over the same pages), parsed
    without numpy.memmap's per-view Python hook. The view keeps the map open as its base."""
    import gguf
    import numpy as np

    ARRAY, STRING = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING

    class _PlainViewReader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain = mapped.view(np.ndarray)

        def _get_field_parts(self, orig_offs: int, raw_type: int):
            """gguf's parts, built in one pass for arrays of strings or numbers (the
            tokenizer's vocabulary, merges and token types): gguf recurses per element,
            ~7 us each, 0.7 s for the default model's ~150,000 elements."""
            parts = self._array_parts(orig_offs, raw_type) if self.byte_order == "I" else None
            return super()._get_field_parts(orig_offs, raw_type) if parts is None else parts

        def _array_parts(self, orig_offs: int, raw_type: int):
            if raw_type != ARRAY:
                return None
            u8 = self._plain
            head = u8[orig_offs : orig_offs + 12]
            raw_itype, alen = head[:4].view(np.uint32), head[4:].view(np.uint64)
            item_type, count = gguf.GGUFValueType(int(raw_itype[0])), int(alen[0])
            if count == 0 or (item_type != STRING and item_type not in self.gguf_scalar_to_np):
                return None  # empty and nested arrays: gguf's own walk
            offs = orig_offs + 12
            parts: list[np.ndarray] = [raw_itype, alen]
            if item_type == STRING:  # each string: its uint64 length, then its bytes
                buf = memoryview(u8)
                for _ in range(count):
                    n = int.from_bytes(buf[offs : offs + 8], sys.byteorder)
                    parts += (u8[offs : offs + 8].view(np.uint64), u8[offs + 8 : offs + 8 + n])
                    offs += 8 + n
                data = list(range(3, 2 * count + 2, 2))
            else:
                items = u8[offs : offs + count * np.dtype(self.gguf_scalar_to_np[item_type]).itemsize]
                items = items.view(self.gguf_scalar_to_np[item_type])
                parts += (items[i : i + 1] for i in range(count))
                offs += items.nbytes
                data = list(range(2, count + 2))
            return offs - orig_offs, parts, data, [ARRAY, item_type]

    return _PlainViewReader


def _key(path: str) -> tuple[str, int, int]:
    st = os.stat(path)
    return os.path.realpath(path), st.st_size, st.st_mtime_ns


def gguf_reader(path: str):
    """The parsed `gguf.GGUFReader` of `path`, shared until `release_gguf_reader(path)` (a
    rewritten file is parsed again)."""
    key = _key(path)
    with _lock:
        reader = _readers.get(key)
        if reader is None:
            while len(_readers) >= MAX_READERS:
                del _readers[next(iter(_readers))]
            reader = _readers[key] = _parse(path)
        return reader


def _parse(path: str):
    """The reader of `path`, or a ValueError naming the file and what is wrong with it. A Git LFS
    pointer (a repository cloned without git-lfs), an empty or a truncated download each stopped
    `kvserve serve`, `generate` and `plan` with numpy's words and no file: "GGUF magic invalid",
    "cannot mmap an empty file", "cannot reshape array of size 503360 into shape (576,960)"."""
    with open(path, "rb") as f:
        head = f.read(64)
    if head[:4] != b"GGUF":
        if head.startswith(b"version https://git-lfs"):
            why = "a Git LFS pointer, not the file itself: fetch it with `git lfs pull` or download it"
        elif not head:
            why = "empty (0 bytes), not a GGUF file"
        else:
            why = f"not a GGUF file (it starts with {head[:4]!r}, not b'GGUF')"
        raise ValueError(f"model: {path!r} is {why}")
    try:
        return _reader_class()(path)
    except (ValueError, IndexError, KeyError, OverflowError, TypeError) as e:  # numpy's, gguf's
        size = os.path.getsize(path)
        raise ValueError(
            f"model: {path!r} is not a complete GGUF file ({size:,} bytes; a truncated download?): {e}"
        ) from None


def gguf_field(reader, key: str, default=None):
    """A metadata field's value (`contents()`), or `default` where the file has no such key."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def release_gguf_reader(path: str) -> None:
    """Forget the reader of `path`: its weights are loaded."""
    real = os.path.realpath(path)
    with _lock:
        for key in [k for k in _readers if k[0] == real]:
            del _readers[key]
