"""The tokenizer alone, without torch: what the API server process loads (it never runs the
model), and what the engine core loads beside the model. A GGUF's tokenizer needs no torch, so
a GGUF server's API process never imports it; for an HF directory transformers' AutoTokenizer
imports it itself.

A Hugging Face directory's tokenizer comes from its tokenizer files through transformers; a
GGUF's is rebuilt from the file's vocabulary with transformers' GGUF converter, then wrapped
with the file's chat template.
"""

from __future__ import annotations

import json
import os

from kvserve.model.loader.gguf_file import gguf_field, gguf_reader
from kvserve.model.loader.resolve import ModelSource
from kvserve.tokenizer import Tokenizer


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """Only the tokenizer (what the API server process needs)."""
    if source.kind == "hf":
        return Tokenizer(hf_tokenizer(source.path))
    return Tokenizer(gguf_tokenizer(gguf_reader(source.path)))


def check_tokenizer_fits(name: str, tokenizer: Tokenizer, vocab_size: int) -> None:
    """A --tokenizer whose ids pass the model's embedding rows would index past them (a crash
    in a step, or another token's row): refused when the engine starts, naming the option."""
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"tokenizer: {name!r} has {tokenizer.vocab_size} tokens, more than the model's {vocab_size} "
            "embedding rows; give the model's own tokenizer or one of its vocabulary"
        )


def hf_tokenizer(path: str):
    """transformers' AutoTokenizer for the directory, without its most expensive step.

    AutoTokenizer loads the model's config class first (for Llama that imports activations,
    hub kernels and model-loading code: seconds per process, and the server pays it in the API
    process and again in the engine core). Where tokenizer_config.json names its class and
    brings no remote code, that config only supplies strings (model type, name), so a plain
    `PretrainedConfig` carrying them picks the same class by the same rules.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, **_light_config(path))


def _light_config(path: str) -> dict:
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            tok_cfg = json.load(f)
        with open(os.path.join(path, "config.json")) as f:
            model_cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    if not tok_cfg.get("tokenizer_class") or "auto_map" in tok_cfg or "auto_map" in model_cfg:
        return {}
    from transformers import PretrainedConfig

    config = PretrainedConfig()
    config.model_type = model_cfg.get("model_type", "")
    config.tokenizer_class = model_cfg.get("tokenizer_class")
    config._name_or_path = path
    return {"config": config}


def gguf_tokenizer(reader):
    """transformers' fast tokenizer rebuilt from the GGUF vocabulary and chat template. Its
    post-processor adds the BOS / EOS the file asks for (tokenizer.ggml.add_bos_token, where
    absent llama.cpp's default; add_eos_token, default off), as transformers' own GGUF
    tokenizer does: so `LLM.get_tokenizer().encode` gives the engine's ids (it added neither:
    a script tokenizing for prompt_token_ids lost a Llama 2 / Mistral file's BOS), and a file
    that sets add_eos_token (an embedding model pooling its last token) gets its EOS."""
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    arch = gguf_field(reader, "general.architecture")
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    spec = {
        "tokenizer_type": gguf_field(reader, "tokenizer.ggml.model"),
        "pre_tokenizer_type": gguf_field(reader, "tokenizer.ggml.pre"),
        "tokens": tokens,
        "token_type": gguf_field(reader, "tokenizer.ggml.token_type"),
        "merges": gguf_field(reader, "tokenizer.ggml.merges"),
        "scores": gguf_field(reader, "tokenizer.ggml.scores"),
        "add_prefix_space": gguf_field(reader, "tokenizer.ggml.add_space_prefix"),
    }
    special = {}
    for name, key in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("unk", "unknown_token_id"),
        ("pad", "padding_token_id"),
    ):
        tid = gguf_field(reader, f"tokenizer.ggml.{key}")
        spec[f"{name}_token_id"] = tid
        if tid is not None:
            special[f"{name}_token"] = tokens[tid]
    spec = {k: v for k, v in spec.items() if v is not None}
    backend, _ = convert_gguf_tokenizer(arch, spec)
    if spec.get("pre_tokenizer_type") in ("smollm", "starcoder"):
        # These vocabularies were trained with every digit split off on its own.
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    default = gguf_adds_bos_by_default(spec["tokenizer_type"], spec.get("pre_tokenizer_type"))
    add_bos = bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", default)) and "bos_token" in special
    add_eos = bool(gguf_field(reader, "tokenizer.ggml.add_eos_token", False)) and "eos_token" in special
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, add_bos_token=add_bos, add_eos_token=add_eos, **special
    )
    tok.chat_template = gguf_field(reader, "tokenizer.chat_template")
    return tok


# The BPE pre-tokenizers after which llama.cpp adds a BOS where the file does not say
# (llama-vocab.cpp): Llama 3's first conversions wrote no tokenizer.ggml.add_bos_token.
_BOS_BPE_PRE_TOKENIZERS = frozenset(
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
     "jina-v5-nano", "tekken", "chameleon")
)  # fmt: skip


def gguf_adds_bos_by_default(tokenizer_type: str | None, pre_tokenizer: str | None) -> bool:
    """llama.cpp's add_bos where a file has no tokenizer.ggml.add_bos_token: a sentencepiece
    vocabulary's always, a BPE one's after the pre-tokenizers above (a Llama 3 file without the
    key was prompted without <|begin_of_text|>, unlike llama.cpp and transformers)."""
    if tokenizer_type == "llama":
        return True
    return tokenizer_type == "gpt2" and pre_tokenizer in _BOS_BPE_PRE_TOKENIZERS
