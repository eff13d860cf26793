#!/bin/bash
# Run a command as on an AVX2-only x86 machine (no AVX-512, no AMX), on any x86 Linux host:
# the check that the ISA dispatch never executes an instruction the CPU lacks, which an
# AVX-512 host cannot make by itself (a wrong variant would run fine there).
#
#   sudo apt-get install qemu-user        # Debian's QEMU 7.2: its TCG CPU has AVX2 + FMA
#   benchmarks/avx2_emulated.sh .venv/bin/python -m pytest -q tests/test_quant_native.py
#   benchmarks/avx2_emulated.sh --native .venv/bin/python benchmarks/bench_cpu_serve.py
#
# Three things change, each what a real AVX2 machine would show:
# - the CPU: QEMU user mode's `-cpu max` (CPUID says AVX2 and FMA, no AVX-512 or AMX, and
#   executing one is an illegal instruction);
# - /proc/cpuinfo, which kvserve's detection reads (platform/cpu_isa.py) and QEMU passes
#   through from the host: a copy without the AVX-512 / AMX / AVX-VNNI flags is bind-mounted
#   over it in a private mount namespace (needs root, for `unshare -m`);
# - `-march=native` in the C++ builds (csrc/ attention and decode-stack module): compilers
#   run natively, outside QEMU, and would see the host; a wrapper passes -march=haswell.
# Builds go to their own TORCH_EXTENSIONS_DIR. Only this process (and its forks) is emulated:
# a program it executes runs natively, so use in-process tests (the offline engine, not the
# server's processes). Everything runs ~50-100x slower than natively (the quantized-kernel
# tests took 11 minutes, 7 s natively), so timings mean nothing here.
#
# --native: the same flags and builds without QEMU, plus the libraries' own caps
# (ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2, MKL_ENABLE_INSTRUCTIONS=AVX2), so every
# path takes the code an AVX2-only CPU runs, at this host's speed, in every process the
# command starts (servers included). For timings of those paths; it cannot show that no
# wider instruction runs (this CPU would execute one), and the cores are still this host's.
set -euo pipefail

if [ "${1:-}" = "--native" ]; then
  export KVSERVE_AVX2_NATIVE=1
  shift
fi
if [ "$#" -eq 0 ]; then
  echo "usage: $0 [--native] COMMAND [ARGS...]" >&2
  exit 2
fi
if [ -z "${KVSERVE_AVX2_NATIVE:-}" ]; then
  command -v qemu-x86_64 >/dev/null || { echo "needs qemu-user (apt-get install qemu-user)" >&2; exit 2; }
fi
[ "$(id -u)" = 0 ] || { echo "needs root (unshare -m and a bind mount)" >&2; exit 2; }

if [ -z "${KVSERVE_EMULATED_AVX2:-}" ]; then
  export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/kvserve-avx2-extensions}"
  work="$TORCH_EXTENSIONS_DIR/emulation"  # rewritten each run: nothing left behind per run
  mkdir -p "$work"
  # /proc/cpuinfo without the flags an AVX2-only CPU lacks
  sed -E '/^flags/ s/ (avx512[a-z0-9_]*|amx[a-z0-9_]*|avx_vnni[a-z0-9_]*|avx_ifma|avx_ne_convert)\b//g' \
    /proc/cpuinfo >"$work/cpuinfo"
  cat >"$work/c++" <<'EOF'
#!/bin/bash
args=()
for a in "$@"; do [ "$a" = "-march=native" ] && a="-march=haswell"; args+=("$a"); done
exec g++ "${args[@]}"
EOF
  chmod +x "$work/c++"
  export KVSERVE_EMULATED_AVX2="$work" CXX="$work/c++"
  exec unshare -m "$0" "$@"
fi

mount --bind "$KVSERVE_EMULATED_AVX2/cpuinfo" /proc/cpuinfo
if [ -n "${KVSERVE_AVX2_NATIVE:-}" ]; then
  export ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
  echo "AVX2-only paths, native: flags $(grep -m1 '^flags' /proc/cpuinfo | grep -o -w 'avx2\|fma\|avx512[a-z_]*\|amx[a-z_]*' | sort -u | tr '\n' ' ')" >&2
  exec "$@"
fi
echo "emulated AVX2-only: flags $(grep -m1 '^flags' /proc/cpuinfo | grep -o -w 'avx2\|fma\|avx512[a-z_]*\|amx[a-z_]*' | sort -u | tr '\n' ' ')" >&2
exec qemu-x86_64 -cpu max "$@" 2> >(grep -v "TCG doesn't support requested feature" >&2)
