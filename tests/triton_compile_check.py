"""Compile every Triton kernel of the CUDA backend for a GPU that is not here.

Triton's interpreter (tests/test_triton_kernels.py) checks what the kernels compute but not
whether they compile: it is lenient where the compiler is not (operand shapes of tl.div_rn,
tl.dot tile sizes, types of constexpr arguments). Triton compiles to a cubin without a device
when given the target, with the ptxas its wheel bundles, so this script does, for sm_90 (H100,
H200) by default, in the configurations kvserve launches (bf16 with a bf16 cache, bf16 with fp8,
fp32 with int8 and IEEE dots), and prints each kernel's registers, spill stack and shared memory
(read back from the cubin with the bundled cuobjdump).

Run without TRITON_INTERPRET (the interpreter replaces kernels with Python functions):
`python tests/triton_compile_check.py [compute capability, e.g. 90]`; exit status 0 when all
compiled. tests/test_triton_kernels.py runs it in a subprocess.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

HEAD_DIM, BLOCK_SIZE = 128, 16  # Llama-3-8B's head_dim, kvserve's default block size


def _compile(
    fn, pointers: dict[str, str], floats: tuple[str, ...], constexprs: dict, cc: int, warps: int
) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in fn.arg_names:
        if name in pointers:
            signature[name] = pointers[name]
        elif name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = "fp32" if name in floats else "i32"
    source = ASTSource(fn, signature, constexprs)
    kernel = triton.compile(source, target=GPUTarget("cuda", cc, 32), options={"num_warps": warps})
    return _resources(kernel.asm["cubin"])


def _resources(cubin: bytes) -> str:
    """'REG:n STACK:n SHARED:n' from the bundled cuobjdump (empty if it cannot say)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            out = subprocess.run(
                [tool, "--dump-resource-usage", f.name], capture_output=True, text=True
            ).stdout
        except OSError:
            return ""
    return " ".join(re.findall(r"(?:REG|STACK|SHARED):\d+", out))


def main(cc: int) -> int:
    from kvserve.attention_backends.triton_kernels import decode_reduce, kv_write, paged_decode, paged_prefill

    failed = 0
    configs = [("bf16", "bf16", False), ("bf16", "fp8e4nv", True), ("fp32", "i8", True)]
    for act, cache, quant in configs:
        scales = "*bf16" if quant else f"*{cache}"
        kv = dict(k_cache_ptr=f"*{cache}", v_cache_ptr=f"*{cache}", k_scale_ptr=scales, v_scale_ptr=scales)
        dots = dict(DOT_PRECISION="ieee" if act == "fp32" else "tf32", UPCAST=False)
        jobs = [
            (kv_write._kv_write_kernel, dict(k_ptr=f"*{act}", v_ptr=f"*{act}", slot_ptr="*i64", **kv), (),
             dict(BLOCK_SIZE=BLOCK_SIZE, KV_HEADS=8, BLOCK_H=8, HEAD_DIM=HEAD_DIM, BLOCK_D=HEAD_DIM,
                  QUANT=quant, FP8=cache == "fp8e4nv", QMAX=448.0 if cache == "fp8e4nv" else 127.0)),
            (paged_decode._paged_decode_kernel,
             dict(q_ptr=f"*{act}", tables_ptr="*i32", seq_lens_ptr="*i32", acc_ptr="*fp32", m_ptr="*fp32",
                  l_ptr="*fp32", **kv), ("sm_scale",),
             dict(GROUP=4, BLOCK_G=16, HEAD_DIM=HEAD_DIM, BLOCK_D=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE,
                  NUM_HEADS=32, QUANT=quant, **dots)),
            (paged_prefill._paged_prefill_kernel,
             dict(q_ptr=f"*{act}", out_ptr=f"*{act}", tables_ptr="*i32", query_start_ptr="*i32",
                  context_lens_ptr="*i32", **kv), ("sm_scale",),
             dict(GROUP=4, HEAD_DIM=HEAD_DIM, BLOCK_D=HEAD_DIM, BLOCK_M=32 if act == "fp32" else 64,
                  BLOCK_SIZE=BLOCK_SIZE, QUANT=quant,
                  **dots)),
        ]  # fmt: skip
        if act == "bf16" and not quant:
            jobs.append((decode_reduce._decode_reduce_kernel,
                         dict(acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", out_ptr="*bf16"), (),
                         dict(NUM_HEADS=32, BLOCK_S=16, HEAD_DIM=HEAD_DIM, BLOCK_D=HEAD_DIM)))  # fmt: skip
        for fn, pointers, floats, constexprs in jobs:
            label = f"{fn.__name__} ({act}, {cache} cache, sm_{cc})"
            warps = paged_prefill.NUM_WARPS if fn is paged_prefill._paged_prefill_kernel else 4
            try:
                print(f"OK   {label}: {_compile(fn, pointers, floats, constexprs, cc, warps)}", flush=True)
            except Exception as e:  # report every kernel, then fail
                failed += 1
                print(f"FAIL {label}: {type(e).__name__}: {e}", flush=True)
    return 1 if failed + _layer_ops(cc) else 0


def _layer_ops(cc: int) -> int:
    """The decoder layer's small ops (model/layers/triton_layer_ops.py) for each model dtype, at
    Llama-3-8B's sizes; returns how many failed."""
    from kvserve.model.layers import triton_layer_ops as ops

    failed = 0
    for act, rounding in (("bf16", ops.BF16), ("fp32", ops.NO_ROUNDING)):
        t = f"*{act}"
        jobs = [
            (ops._rms_norm_kernel, dict(X=t, Y=t, W=t, OUT=t), ("eps",),
             dict(ADD=True, ROUND=rounding, BLOCK=4096), 8),
            (ops._rotary_kernel, dict(T=t, COS=t, SIN=t), (), dict(HALF=HEAD_DIM // 2, ROUND=rounding,
             BLOCK=HEAD_DIM // 2), 1),
            (ops._silu_mul_kernel, dict(GU=t, OUT=t), (),
             dict(ROUND=rounding, BLOCK=ops.TritonLayerOps.SILU_BLOCK), 4),
        ]  # fmt: skip
        for fn, pointers, floats, constexprs, warps in jobs:
            label = f"{fn.__name__} ({act}, sm_{cc})"
            try:
                print(f"OK   {label}: {_compile(fn, pointers, floats, constexprs, cc, warps)}", flush=True)
            except Exception as e:  # report every kernel, then fail
                failed += 1
                print(f"FAIL {label}: {type(e).__name__}: {e}", flush=True)
    return failed


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: the interpreter does not compile")
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 90))
