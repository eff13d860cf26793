"""Each weight is held once: oneDNN packing replaces the float Parameter; a tied table is
kept for lookups beside its packed lm_head only where the embedding looks tokens up in it,
and then in its smallest exact form. (Greedy
output against transformers with the packed weights is tests/test_fidelity.py's.) These are
oneDNN's layouts: on an AVX-512 CPU without AMX kvserve's panels would take their place, and a
tied table is then held once (tests/test_float_panels.py), so they are switched off here."""

from __future__ import annotations

import pytest
import torch
from helpers import q8_0_like_table

from kvserve.model.loader import load_weights_only, resolve_model


@pytest.fixture(autouse=True)
def onednn_packing(monkeypatch):
    monkeypatch.setenv("KVSERVE_FLOAT_PANELS", "0")


def _load(path: str):
    return load_weights_only(resolve_model(path), torch.float32, torch.device("cpu"))


def test_packing_replaces_the_parameters(tiny_llama_dir):
    model = _load(tiny_llama_dir)
    before = model.weight_bytes()
    model.pack_weights()
    for layer in model.layers:
        for proj in layer.projections().values():
            assert proj.packed is not None and proj.weight.numel() == 0
    assert model.lm_head.weight.numel() == 0  # untied: packed only
    assert model.weight_bytes() == before and model.duplicate_weight_bytes() == 0


def test_tied_table_kept_for_lookups(tiny_qwen2_dir):
    model = _load(tiny_qwen2_dir)
    table = model.embed.weight.detach().clone()
    before = model.weight_bytes()
    model.pack_weights()
    assert model.lm_head.weight is model.embed.weight and torch.equal(model.embed.weight, table)
    assert model.weight_bytes() == before and model.duplicate_weight_bytes() == table.nbytes
    hidden = torch.randn(3, table.shape[1])
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ table.t(), rtol=1e-5, atol=1e-5)
    model.is_first_stage = False  # a last pipeline stage never looks tokens up: packed only
    model.lm_head.packed = None
    model.pack_weights()
    assert model.embed.weight.numel() == 0 and model.duplicate_weight_bytes() == 0
    assert model.weight_bytes() == before


def test_tied_q8_table_held_compact_for_lookups(tiny_qwen2_dir):
    """A tied table with an exact int8-per-group form (the default GGUF's Q8_0 table) is held
    for lookups as codes and scales, not a second float32 copy; lookups return its values."""
    model = _load(tiny_qwen2_dir)
    table = q8_0_like_table(*model.embed.weight.shape)
    model.embed.weight.data = table.clone()
    before = model.weight_bytes()
    model.pack_weights()
    assert model.embed.weight.numel() == 0 and model.embed.lookup is not None
    assert model.embed.lookup.codes.dtype == torch.int8 and model.embed.lookup.scales.dtype == torch.float16
    assert model.duplicate_weight_bytes() == model.embed.lookup.nbytes() < table.nbytes / 3
    assert model.weight_bytes() == before
    ids = torch.arange(table.shape[0]).flip(0)
    assert torch.equal(model.embed(ids, torch.float32), table[ids])
    hidden = torch.randn(3, table.shape[1])
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ table.t(), rtol=1e-5, atol=1e-5)
