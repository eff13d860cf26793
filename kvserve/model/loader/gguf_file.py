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
"""

from __future__ import annotations

import functools
import os
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

    class _PlainViewReader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain = mapped.view(np.ndarray)

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
            reader = _readers[key] = _reader_class()(path)
        return reader


def release_gguf_reader(path: str) -> None:
    """Forget the reader of `path`: its weights are loaded."""
    real = os.path.realpath(path)
    with _lock:
        for key in [k for k in _readers if k[0] == real]:
            del _readers[key]
