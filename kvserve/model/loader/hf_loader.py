"""Load a Hugging Face model directory: config.json, *.safetensors (the tokenizer files:
tokenizer_loader.py)."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator

import torch
from safetensors import safe_open

from kvserve.model.arch import ModelArch


def hf_arch(path: str) -> ModelArch:
    """The architecture config.json describes; ValueError naming the file when it cannot (a
    missing field was a KeyError traceback from `kvserve serve` / `generate`)."""
    config = os.path.join(path, "config.json")
    with open(config) as f:
        try:
            cfg = json.load(f)
        except ValueError as e:
            raise ValueError(f"model: {config!r} is not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"model: {config!r} is not a JSON object")
    extra: tuple[int, ...] = ()
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            extra = tuple(eos if isinstance(eos, list) else [eos])
    try:
        return ModelArch.from_hf_config(cfg, eos_extra=extra)
    except KeyError as e:
        raise ValueError(f"model: {config!r} has no {e.args[0]}, part of the model's shape") from None
    except TypeError as e:  # a number written as a string, a list for a number, ...
        raise ValueError(f"model: {config!r} has a field of the wrong type ({e})") from None


def weight_files(path: str) -> list[str]:
    """The checkpoint's files as transformers picks them: model.safetensors, else those
    model.safetensors.index.json maps tensors to, else every *.safetensors. Mistral's
    repositories ship consolidated.safetensors (its own tensor names) beside the sharded files:
    reading every file refused the model on a name it did not know. A sharded directory saved
    over as one file keeps its stale index (save_pretrained deletes only the shards): reading
    the index first refused it over the shards it names."""
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f).get("weight_map", {}).values()))
        files = [os.path.join(path, n) for n in names]
        missing = [n for n, f in zip(names, files) if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"model: {path!r} lacks {missing}, which its safetensors index names")
        if files:
            return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"model: no *.safetensors files in {path!r}")
    return files


WeightSlice = Callable[[str, tuple[int, ...]], "tuple[int, int, int] | None"]


def hf_weights(
    path: str, weight_slice: WeightSlice | None = None, keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor by name; with `weight_slice` (a tensor-parallel rank's) only the
    (dim, start, stop) slice it names is read from the file; tensors `keep` rejects (another
    pipeline stage's) are not read at all."""
    for file in weight_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if keep is not None and not keep(name):
                    continue
                if weight_slice is None:
                    yield name, f.get_tensor(name)
                    continue
                lazy = f.get_slice(name)
                cut = weight_slice(name, tuple(lazy.get_shape()))
                if cut is None:
                    yield name, lazy[:]
                else:
                    dim, a, b = cut
                    yield name, lazy[a:b] if dim == 0 else lazy[:, a:b]
