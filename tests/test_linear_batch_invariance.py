"""A bfloat16 projection gives each row the same bits whatever the number of rows beside it.

oneDNN takes another bf16 kernel from 33 rows (K >= ~512) whose fp32 sums round to other bf16
bits, so a row's result, and a greedy request's text, depended on the batch
(model/layers/linear.py runs bf16 batches in runs of 32 rows)."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.layers.linear import linear, onednn_pack
from kvserve.model.layers.quantization import quantize_weight
from kvserve.model.layers.quantized_linear import QuantizedLinear


@pytest.mark.parametrize("packed", [True, False])
def test_a_bf16_row_has_the_same_bits_in_any_batch(packed):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(960, 576, generator=g) * 0.05).bfloat16()
    x = torch.randn(80, 576, generator=g).bfloat16()
    p = onednn_pack(w) if packed else None
    if packed and p is None:
        pytest.skip("no oneDNN bf16 packing here")
    alone = torch.cat([linear(x[i : i + 1], w, None, p) for i in range(len(x))])
    for m in (2, 32, 33, 40, 64, 80):
        assert torch.equal(linear(x[:m], w, None, p), alone[:m]), f"{m} rows"
    assert torch.equal(linear(x.view(8, 10, 576), w, None, p), alone.view(8, 10, -1))


def test_an_fp8_projection_on_the_cpu_too():
    """fp8 weights on the CPU multiply in bf16 (QuantizedLinear): the same rule."""
    g = torch.Generator().manual_seed(1)
    layer = QuantizedLinear(quantize_weight(torch.randn(960, 576, generator=g) * 0.05, "fp8"), "cpu")
    x = torch.randn(80, 576, generator=g)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    for m in (33, 40, 80):
        assert torch.equal(layer(x[:m]), alone[:m]), f"{m} rows"


def test_a_bf16_model_gives_the_same_greedy_bits_alone_and_beside_40_others(tmp_path):
    """A 512-wide model with an 8,192-token head (shapes where oneDNN's kernels differ): a prompt
    alone, then among 40 others (44-row decode steps): the same tokens and logprobs to the bit."""
    from conftest import _save_tiny

    path = _save_tiny(str(tmp_path), "llama", hidden_size=512, intermediate_size=1024,
                      num_attention_heads=8, vocab_size=8192)  # fmt: skip
    llm = LLM(path, dtype="bfloat16", kv_cache_memory="32MiB")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    prompts = [[(5 * j + 7 * i) % 500 + 3 for j in range(8 + i % 5)] for i in range(41)]

    def bits(outs):
        firsts = [o.outputs[0] for o in outs]
        return [(c.token_ids, [lp[t] for lp, t in zip(c.logprobs, c.token_ids)]) for c in firsts]

    alone = bits(llm.generate(prompts[:1], params, use_tqdm=False))[0]
    assert bits(llm.generate(prompts, params, use_tqdm=False))[0] == alone
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
