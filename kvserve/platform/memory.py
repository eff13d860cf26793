"""Give freed heap memory back to the OS (glibc's malloc_trim).

glibc keeps most freed memory inside its arenas, where it counts in the process's RSS for
the rest of its life. Three places free a lot of it:
- loading builds every weight through temporaries (dequantized GGUF blocks, fused q|k|v and
  gate|up copies, the plain matrices that oneDNN packing replaces): about 250 MiB for the
  default model (benchmarks/bench_memory.py); the model runner trims once after loading;
- a batch run makes short-lived native allocations per line (response JSON, output
  records, ZeroMQ frames, msgpack buffers) between long-lived ones, which crept up ~0.3 MB
  per 1,000 lines with live Python memory flat; the batch runner trims every 1,000 lines
  and the upload route after copying a file (benchmarks/bench_batch.py).
- a burst of steps leaves its temporaries (a prefill's activations, a batch's logits) in
  the arenas: ~40 MiB after 8 prompts of 65 tokens on the default model; the offline engine
  trims when its last request has finished, the server's core process once it has been idle
  for a poll interval (250 ms), so back-to-back requests do not fault the pages in again.
A trim takes a few milliseconds. Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def libc():
    """glibc through ctypes, or None where this is not glibc (no malloc_trim)."""
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None


def trim_heap() -> bool:
    """Return free heap pages to the OS; True where glibc's malloc_trim ran."""
    lib = libc()
    if lib is None:
        return False
    lib.malloc_trim(0)
    return True
