"""Builds and loads kvserve's small C++ CPU kernels (paged decode attention).

Compiled once per machine with torch's extension builder (needs a C++ compiler; the result
is cached under TORCH_EXTENSIONS_DIR). The module name carries a hash of the source, so
checkouts with different kernel sources never load each other's build. If building fails,
callers fall back to the pure PyTorch path, which computes the same thing more slowly.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading

logger = logging.getLogger(__name__)

_SRC = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "csrc", "paged_attention_cpu.cpp"
)
_lock = threading.Lock()
_module = None
_failed = False


def load_cpu_kernels():
    """The compiled module, or None if it cannot be built here."""
    global _module, _failed
    with _lock:
        if _module is not None or _failed:
            return _module
        if os.environ.get("KVSERVE_DISABLE_CPU_KERNELS"):
            _failed = True
            return None
        try:
            from torch.utils.cpp_extension import load

            flags = ["-O3", "-fopenmp", "-march=native", "-ffast-math",
                     ]  # fmt: skip
            with open(_SRC, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()[:10]
            _module = load(
                name=f"kvserve_cpu_kernels_{digest}",
                sources=[_SRC],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as e:  # no compiler, no headers: the torch path still works
            logger.warning("CPU attention kernel unavailable (%s); using the PyTorch path", e)
            _failed = True
        return _module
