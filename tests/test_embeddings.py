"""Embedding requests (SamplingParams.pooling): the engine's pooled final hidden states equal
transformers' on the same weights, whatever the chunking, batching or prefix cache."""

from __future__ import annotations

import pytest
import torch
from conftest import load_reference

from kvserve import LLM, SamplingParams


def reference_embedding(hf_model, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), output_hidden_states=True)
    hidden = out.hidden_states[-1][0].float()  # after the final norm
    return hidden[-1] if pooling == "last" else hidden.mean(0)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_states_match_transformers(tiny_llama_dir, pooling):
    ref = load_reference(tiny_llama_dir)
    llm = LLM(tiny_llama_dir, kv_cache_memory="16MiB", max_num_batched_tokens=24)  # prompts span chunks
    shared = list(range(5, 45))
    prompts = [shared + [50 + i] * (i + 1) for i in range(6)] + [[7], list(range(100, 170))]
    params = SamplingParams(max_tokens=1, pooling=pooling)
    for round_ in range(2):  # the second round finds the shared prefix cached
        outs = llm.generate(prompts, params, use_tqdm=False)
        for p, o in zip(prompts, outs):
            got = torch.tensor(o.embedding)
            cos = torch.nn.functional.cosine_similarity(got, reference_embedding(ref, p, pooling), dim=0)
            assert cos.item() >= 0.9999, (round_, len(p), cos.item())
            assert o.outputs[0].token_ids == [] and o.outputs[0].finish_reason == "stop"
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    if pooling == "last":
        assert kv.prefix_cache_hits > 0  # last pooling may reuse cached prefixes; mean never does


def test_embedding_and_generation_share_a_batch(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory="16MiB")
    gen = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate([[3, 4, 5]], gen, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(
        [[3, 4, 5], [9, 8, 7, 6]], [gen, SamplingParams(max_tokens=1, pooling="last")], use_tqdm=False
    )
    assert mixed[0].outputs[0].token_ids == alone and mixed[1].embedding is not None
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(pooling="max")
