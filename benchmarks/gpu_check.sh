#!/usr/bin/env bash
# The CUDA backend's acceptance check (issue 20), for a machine with an NVIDIA GPU and a CUDA
# build of torch (which brings triton). Not part of `make test`. About 8 minutes on an H200:
#   (a) the CUDA test subset: tests/test_triton_kernels.py (the Triton kernels compiled for the
#       GPU, not interpreted, and the Triton backend against the torch path through the engine),
#       tests/test_triton_layer_ops.py (the layers' small ops against the torch path),
#       tests/test_cuda_cpu_side.py and tests/test_device_sampling.py (sampling on the GPU
#       against the host sampler through the engine);
#   (b)-(d) benchmarks/gpu_check.py: greedy fidelity against transformers on the GPU, batch-1
#       decode of an 8B-shaped Llama against the HBM roofline, throughput on nano-vllm's shape
#       against transformers generate and against kvserve --enforce-eager.
# Usage: benchmarks/gpu_check.sh [RESULTS.json]   (default gpu_check_results.json; the log
# goes beside it). PYTHON=... picks the interpreter. Exit status: 0 when everything passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_check_results.json}
LOG=${OUT%.json}.log
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET KVSERVE_ATTENTION_BACKEND KVSERVE_DEVICE_SAMPLING

"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA device")' || exit 2
"$PY" -c 'import triton' || { echo "triton is not importable (a CUDA torch build installs it)"; exit 2; }
: >"$LOG"
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' | tee -a "$LOG"

echo "== (a) CUDA test subset" | tee -a "$LOG"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_triton_layer_ops.py \
    tests/test_cuda_cpu_side.py tests/test_device_sampling.py 2>&1 | tee -a "$LOG"
tests_rc=${PIPESTATUS[0]}

echo "== (b)-(d) fidelity and benchmarks" | tee -a "$LOG"
timeout 480 "$PY" benchmarks/gpu_check.py --out "$OUT" --tests-rc "$tests_rc" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
echo "results: $OUT, log: $LOG (tests rc $tests_rc, checks rc $rc)" | tee -a "$LOG"
exit $(( tests_rc != 0 || rc != 0 ))
