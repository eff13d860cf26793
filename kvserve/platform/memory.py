"""Give freed heap memory back to the OS after loading.

Loading builds every weight through temporaries (dequantized GGUF blocks, fused q|k|v and
gate|up copies, the plain matrices that oneDNN packing replaces); glibc keeps most of what
they freed inside its arenas, where it counts in the process's RSS for the rest of its life
(measured: about 250 MiB for the default model, benchmarks/bench_memory.py). `malloc_trim`
returns it. Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None


def trim_heap() -> bool:
    """Return free heap pages to the OS; True where glibc's malloc_trim ran."""
    lib = _libc()
    if lib is None:
        return False
    lib.malloc_trim(0)
    return True
