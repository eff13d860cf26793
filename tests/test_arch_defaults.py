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
