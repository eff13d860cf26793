"""Builds and loads kvserve's small C++ CPU kernels: paged decode attention, the fused
per-layer ops (RMSNorm, rotary, KV write, SiLU-and-multiply), the decode stack that runs
a decode step's layers in one call and greedy's row argmax, one extension from csrc/.

Compiled once per machine with torch's extension builder (needs a C++ compiler; the result
is cached under TORCH_EXTENSIONS_DIR). The module name carries a hash of the sources, the
flags, this CPU's instruction sets (the build uses -march=native, so a build made on an
AVX-512 machine must never be loaded on an AVX2 one sharing the cache) and the torch install
built against; the sources are copied into the build folder, so every checkout on one venv
writes the same build file and none forces a rebuild for the others.

torch guards a build with a plain `lock` file that a killed builder leaves behind, and then
every later load waits on it forever. We hold our own fcntl lock around the build (the OS
drops it when its holder dies), so under it any torch `lock` file is stale and is removed.
If building fails, callers fall back to the pure PyTorch path, which computes the same
thing more slowly.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import threading

from kvserve.platform.cpu_isa import cpu_flags_line

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "csrc")
SOURCES = [
    os.path.join(_CSRC, name)
    for name in (
        "paged_attention_cpu.cpp",
        "layer_ops_cpu.cpp",
        "decode_stack_cpu.cpp",
        "decode_overlap_cpu.cpp",
        "sampling_cpu.cpp",
        "cpu_kernels_bindings.cpp",
    )
]
# Copied beside the sources, hashed with them.
HEADERS = [os.path.join(_CSRC, name) for name in ("cpu_kernels.h", "decode_stack.h")]
_CFLAGS = ["-O3", "-fopenmp", "-march=native", "-ffast-math"]
_lock = threading.Lock()
_module = None
_failed = False


def _cpu_flags() -> str:
    """The first `flags` line of /proc/cpuinfo ('' where there is none)."""
    return cpu_flags_line()


def extension_name(prefix: str, source: bytes, cflags: list[str], extra: str = "") -> str:
    """`prefix` and a hash of the source, the flags, `extra` and the torch install built against
    (the build file names torch's include and library paths: two venvs sharing one name would
    rewrite it and rebuild in turn). Every kvserve kernel module is named this way."""
    import torch

    where = os.path.dirname(torch.__file__) + torch.__version__
    key = hashlib.sha256(source + " ".join(cflags).encode() + extra.encode() + where.encode())
    return f"{prefix}_{key.hexdigest()[:10]}"


def _build_name(source: bytes) -> str:
    """This module's name: its hash also covers this CPU's flags (the build uses -march=native)."""
    return extension_name("kvserve_cpu_kernels", source, _CFLAGS, _cpu_flags())


def read_sources() -> bytes:
    """The extension's sources and headers, concatenated: what its build name hashes."""
    out = b""
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            out += f.read()
    return out


def build_extension(name: str, src_paths: list[str], cflags: list[str], headers: list[str] = ()):
    """Build (or load the cached build of) one extension from C++ sources (and the headers they
    include, copied beside them) under our own fcntl lock; raises on failure. Shared by every
    kvserve kernel loader."""
    from torch.utils.cpp_extension import _get_build_directory, load

    build_dir = _get_build_directory(name, verbose=False)
    with open(os.path.join(os.path.dirname(build_dir), f"{name}.flock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released by the OS if this process dies
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            logger.info("removing a stale extension build lock %s", stale)
            os.remove(stale)
        copies = []
        for path in [*src_paths, *headers]:
            dst = os.path.join(build_dir, os.path.basename(path))
            with open(path, "rb") as f:
                source = f.read()
            if not os.path.exists(dst) or open(dst, "rb").read() != source:
                shutil.copyfile(path, dst)
            copies.append(dst)
        return load(
            name=name,
            sources=copies[: len(src_paths)],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            build_directory=build_dir,
            verbose=False,
        )


def loaded_cpu_kernels():
    """The module if this process has already loaded it, else None: for callers that must
    never start a build (the sampler, which also runs beside GPU models)."""
    return _module


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
            _module = build_extension(_build_name(read_sources()), SOURCES, _CFLAGS, HEADERS)
        except Exception as e:  # no compiler, no headers: the torch path still works
            logger.warning("CPU attention kernel unavailable (%s); using the PyTorch path", e)
            _failed = True
        return _module
