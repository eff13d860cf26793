"""The server's tokenizer loader skips AutoTokenizer's config import; it must still pick the
class AutoTokenizer picks and encode, decode and template exactly as it does."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from kvserve.model.loader.tokenizer_loader import _light_config, hf_tokenizer

TEXT = "Hello world! héllo 日本語 0123 </s> <s>"


def _variant(src: str, dst: str, tokenizer_class: str | None, auto_map: bool = False) -> str:
    shutil.copytree(src, dst)
    with open(f"{dst}/tokenizer_config.json") as f:
        cfg = json.load(f)
    cfg.pop("tokenizer_class", None)
    if tokenizer_class:
        cfg["tokenizer_class"] = tokenizer_class
    if auto_map:
        cfg["auto_map"] = {"AutoTokenizer": [None, "tok.MyTokenizer"]}
    with open(f"{dst}/tokenizer_config.json", "w") as f:
        json.dump(cfg, f)
    return dst


# None: tokenizer_config.json names no class, so the full AutoTokenizer path runs.
CLASSES = [
    "TokenizersBackend",
    "PreTrainedTokenizerFast",
    "LlamaTokenizer",
    "Qwen2Tokenizer",
    "GPT2Tokenizer",
    None,
]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("cls", CLASSES)
def test_same_tokenizer_as_autotokenizer(kind, cls, tiny_llama_dir, tiny_qwen2_dir, tmp_path):
    path = _variant(tiny_llama_dir if kind == "llama" else tiny_qwen2_dir, str(tmp_path / "m"), cls)
    ours, ref = hf_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(ref)
    assert bool(_light_config(path)) == (cls is not None)  # the fast path is taken only when safe
    ids = ref.encode(TEXT)
    assert ours.encode(TEXT) == ids
    assert ours.decode(ids) == ref.decode(ids)
    assert (ours.bos_token_id, ours.eos_token_id, ours.all_special_ids) == (
        ref.bos_token_id, ref.eos_token_id, ref.all_special_ids
    )  # fmt: skip
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs, tokenize=False) == ref.apply_chat_template(msgs, tokenize=False)


def test_remote_code_takes_the_full_path(tiny_llama_dir, tmp_path):
    path = _variant(tiny_llama_dir, str(tmp_path / "m"), "LlamaTokenizer", auto_map=True)
    assert _light_config(path) == {}
