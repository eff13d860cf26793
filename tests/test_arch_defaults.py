"""kvserve reads a config.json as transformers' config class reads it: where the file leaves a
field out, the class's default. No model is built: the configs alone, so each case is cheap."""

from __future__ import annotations

import pytest

from kvserve.model.arch import ModelArch

SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def _transformers_config(cfg: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_a_config_without_max_position_embeddings_gets_its_class_default(kind):
    """Every architecture got 2048, LlamaConfig's: a Mistral (131072) or Qwen2 (32768) config
    without the key was served a 2048-token context, and a yarn model's original length (which
    defaults to it) rotated other frequencies than transformers'."""
    cfg = {"model_type": kind, **SHAPE}
    ref = _transformers_config(cfg)
    assert ModelArch.from_hf_config(cfg).max_position_embeddings == ref.max_position_embeddings
    if kind == "qwen2":
        yarn = {**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}
        ref = _transformers_config(yarn)
        arch = ModelArch.from_hf_config(yarn)
        original = ref.rope_parameters["original_max_position_embeddings"]
        assert arch.rope_scaling["original_max_position_embeddings"] == original == 32768
        assert arch.max_position_embeddings == 2 * original


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "llama3"])
def test_rope_scaling_without_its_factor_is_refused_naming_it(rope_type):
    """transformers refuses such a config; kvserve read the weights and then failed building its
    rotary tables with a bare KeyError: 'factor'."""
    rope = {"rope_type": rope_type, "rope_theta": 10000.0}
    if rope_type == "llama3":
        rope.update(factor=8.0, high_freq_factor=4.0)
    cfg = {"model_type": "llama", **SHAPE, "rope_parameters": rope}
    missing = "low_freq_factor" if rope_type == "llama3" else "factor"
    with pytest.raises((KeyError, ValueError), match=missing):
        _transformers_config(cfg)
    with pytest.raises(ValueError, match=rf"^rope scaling '{rope_type}' without its {missing}$"):
        ModelArch.from_hf_config(cfg)


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "llama3", "yarn", "default"])
def test_a_scaled_rope_over_part_of_each_head_is_refused_naming_it(rope_type):
    """partial_rotary_factor: transformers' default rope reads none (every dimension rotates,
    as in kvserve); its scaled ropes build tables for part of each head that its attention
    cannot apply (a RuntimeError on the first forward). kvserve rotated every dimension with
    the scaled frequencies, silently, a model no reference runs; only yarn's was refused."""
    import torch
    from transformers import AutoModelForCausalLM

    rope = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0, "partial_rotary_factor": 0.5}
    if rope_type == "llama3":
        rope.update(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)
    cfg = {"model_type": "llama", **SHAPE, "rope_parameters": rope}
    model = AutoModelForCausalLM.from_config(_transformers_config(cfg))
    if rope_type == "default":
        model(torch.tensor([[1, 2, 3]]))
        assert model.model.rotary_emb.inv_freq.numel() == 16 // 2  # the whole head rotates
        assert ModelArch.from_hf_config(cfg).rope_scaling["rope_type"] == "default"
        return
    with pytest.raises(RuntimeError, match="must match the size"):
        model(torch.tensor([[1, 2, 3]]))
    whole = {k: v for k, v in rope.items() if k != "partial_rotary_factor"}
    top_level = {**cfg, "partial_rotary_factor": 0.5, "rope_parameters": whole}
    for c in (cfg, top_level):
        with pytest.raises(ValueError, match=rf"^unsupported {rope_type} rope scaling over part of each head "
                                             r"\(partial_rotary_factor 0\.5\)$"):  # fmt: skip
            ModelArch.from_hf_config(c)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_a_config_without_num_key_value_heads_gets_its_class_default(kind):
    """Every architecture got the query heads: a Mistral config without the key (transformers:
    8 KV heads) over a checkpoint with 8 was refused as "weight shard: 32 rows, expected 64"."""
    cfg = {"model_type": kind, **{k: v for k, v in SHAPE.items() if k != "num_key_value_heads"}}
    cfg["num_attention_heads"] = 32
    ref = _transformers_config(cfg)
    expected = {"mistral": 8}.get(kind, 32)
    assert ModelArch.from_hf_config(cfg).num_kv_heads == ref.num_key_value_heads == expected
    explicit_null = {**cfg, "num_key_value_heads": None}
    assert ModelArch.from_hf_config(explicit_null).num_kv_heads == 32


@pytest.mark.parametrize(("heads", "kv"), [(4, 3), (4, None)])
def test_kv_heads_the_query_heads_cannot_share_are_refused_naming_both(heads, kv):
    """transformers' attention groups num_attention_heads / num_key_value_heads query heads on
    each KV head; kvserve took any count and failed later, or not at all (a Qwen2 config
    without the key has 32 KV heads in transformers)."""
    cfg = {"model_type": "qwen2", **SHAPE, "num_attention_heads": heads}
    if kv is None:
        del cfg["num_key_value_heads"]
    else:
        cfg["num_key_value_heads"] = kv
    with pytest.raises(ValueError, match=rf"^num_attention_heads {heads} is not a multiple of "
                                         rf"num_key_value_heads {kv or 32}$"):  # fmt: skip
        ModelArch.from_hf_config(cfg)
