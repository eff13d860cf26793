"""The decoder layer's small ops as Triton kernels (model/layers/triton_layer_ops.py) against
the torch reference path, on the CPU under TRITON_INTERPRET=1 (on a GPU where there is one).

Each op must give the bits the torch path gives, in float32 and bfloat16: they round where
the reference rounds (float16 is refused: the fused layer path never takes it). Sizes that are
not powers of two (masked lanes), rotary on q and k as strided views of the qkv output, several
rows, and an empty step. Then the whole engine: the fused layer forward with these ops, greedy,
against the torch path."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates any kernel

triton = pytest.importorskip("triton", reason="triton is not importable (pip install '.[test]')")

from kvserve.model.layers.rotary import apply_rotary  # noqa: E402
from kvserve.model.layers.triton_layer_ops import TritonLayerOps  # noqa: E402
from kvserve.model.models.llama import rms_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _same_bits(got: torch.Tensor, want: torch.Tensor, what: str, ulp: bool = False) -> None:
    """Equal; with ulp=True, a float32 summation or exp may move a rounded value by one step
    of its dtype (the ops then differ from torch's own kernels only in float32's last bits)."""
    if not ulp or got.dtype == torch.float32:
        tol = dict(rtol=1e-6, atol=1e-6) if ulp else dict(rtol=0, atol=0)
    else:
        tol = dict(rtol=torch.finfo(got.dtype).eps, atol=torch.finfo(got.dtype).eps)
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms(dtype):
    gen, ops = torch.Generator().manual_seed(0), TritonLayerOps()
    x, o = _randn(gen, 3, 96, dtype=dtype), _randn(gen, 3, 96, dtype=dtype)
    w = _randn(gen, 96, dtype=dtype)
    _same_bits(ops.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), "rms_norm", ulp=True)
    residual = x.clone()
    h = ops.add_rms_norm(residual, o, w, 1e-6)
    _same_bits(residual, x + o, "add_rms_norm's residual")  # in place
    _same_bits(h, rms_norm(x + o, w, 1e-6), "add_rms_norm", ulp=True)
    empty = x[:0]
    assert ops.rms_norm(empty, w, 1e-5).shape == (0, 96)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 24])  # 24: half of it (12) is not a power of two
def test_rotary_in_place_on_qkv_views(dtype, head_dim):
    gen, ops = torch.Generator().manual_seed(1), TritonLayerOps()
    n, heads, kv_heads = 3, 4, 2
    qkv = _randn(gen, n, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    cos, sin = _randn(gen, n, 1, head_dim, dtype=dtype), _randn(gen, n, 1, head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(n, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    before = qkv.clone()
    want_q, want_k = apply_rotary(q.clone(), cos, sin), apply_rotary(k.clone(), cos, sin)
    ops.rotary_inplace(q, cos, sin)
    ops.rotary_inplace(k, cos, sin)
    _same_bits(q, want_q, "rotary q")
    _same_bits(k, want_k, "rotary k")
    v_start = (heads + kv_heads) * head_dim
    _same_bits(qkv[:, v_start:], before[:, v_start:], "v untouched")


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    gen, ops = torch.Generator().manual_seed(2), TritonLayerOps()
    gate_up = _randn(gen, 2, 2 * 1500, dtype=dtype) * 4  # 1500 columns: two blocks, the second masked
    gate, up = gate_up.chunk(2, dim=-1)
    _same_bits(ops.silu_mul(gate_up), F.silu(gate) * up, "silu_mul", ulp=True)


def test_float16_is_refused():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        TritonLayerOps().silu_mul(torch.zeros(1, 8, dtype=torch.float16, device=DEVICE))


def test_engine_with_triton_layer_ops_matches_the_torch_path(tiny_llama_dir, monkeypatch):
    """Greedy tokens of the tiny Llama (float32 and bfloat16) with its layers' small ops
    through the Triton kernels equal those of the plain torch layers, over chunked prefill
    and decodes (the Triton attention backend, as on a GPU)."""
    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling_params import SamplingParams

    monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "triton")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    # 12 and 20 tokens in steps of 16 tokens: the second prompt's prefill is split across steps
    # that also decode the first (kept small: the interpreter makes each step cost seconds)
    prompts = [[5 + i, 9, 40 + i, 17 * i + 3] * (3 + 2 * i) for i in range(2)]
    for dtype in ("float32", "bfloat16"):
        llm = LLM(tiny_llama_dir, dtype=dtype, kv_cache_memory="4MiB", max_num_batched_tokens=16)
        model = llm.llm_engine.core.model_runner.model
        tokens = {}
        for name, ops in (("torch", None), ("triton", TritonLayerOps())):
            model.use_layer_ops(ops)
            assert all(layer.ops is ops for layer in model.layers)
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens[name] = [o.outputs[0].token_ids for o in outs]
        assert tokens["triton"] == tokens["torch"], dtype
        llm.llm_engine.core.shutdown()
