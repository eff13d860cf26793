"""One parse of a GGUF file's metadata per model load.

`gguf.GGUFReader` parses every metadata field when it is constructed, the tokenizer's ~100,000
vocabulary and merge strings included, one numpy view each: 5.1 s for the default model on a
2-core AVX2 EPYC. An engine's start used to ask for the file three times (architecture to
size the KV pool, tokenizer, weights). Now the first ask parses it and the others reuse that
reader until the weights have been read from it; then it is dropped, so its memory map does
not outlive the load. A process that never loads the weights (the API server) keeps its
reader, whose map only had its metadata pages touched; at most `MAX_READERS` are kept (a
model and its draft), the oldest dropped first.
"""

from __future__ import annotations

import os
import threading

MAX_READERS = 2
_readers: dict[tuple[str, int, int], object] = {}  # in the order they were parsed
_lock = threading.Lock()


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
            import gguf

            while len(_readers) >= MAX_READERS:
                del _readers[next(iter(_readers))]
            reader = _readers[key] = gguf.GGUFReader(path)
        return reader


def release_gguf_reader(path: str) -> None:
    """Forget the reader of `path`: its weights are loaded."""
    real = os.path.realpath(path)
    with _lock:
        for key in [k for k in _readers if k[0] == real]:
            del _readers[key]
