"""Load a Hugging Face model directory: config.json, *.safetensors, tokenizer files."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from kvserve.model.arch import ModelArch


def hf_arch(path: str) -> ModelArch:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    extra: tuple[int, ...] = ()
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            extra = tuple(eos if isinstance(eos, list) else [eos])
    return ModelArch.from_hf_config(cfg, eos_extra=extra)


def hf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"model: no *.safetensors files in {path!r}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def hf_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
