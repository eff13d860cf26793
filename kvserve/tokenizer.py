"""The engine's view of a tokenizer: encode, decode, chat template, special ids.

Wraps a transformers fast tokenizer (for chat templates) and exposes its `tokenizers`
backend for incremental detokenization.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback

_RELEASE_GIL_CHARS = 4096  # longer texts are encoded without holding the GIL (server threads)


def lone_surrogate(text: str) -> int | None:
    """Index of the first lone surrogate in `text`, or None. JSON may carry one ("\\ud800") and
    Python keeps it, but it is no character: it cannot be UTF-8, so the tokenizer (a TypeError)
    and the JSON lines written back (UnicodeEncodeError) would fail on it. Callers refuse it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


@functools.cache
def template_call_parameters() -> frozenset[str]:
    """apply_chat_template's own parameters (transformers' and Tokenizer's): chat_template_kwargs
    may not set them, at the server or in `LLM.chat`. They are no template variables: one such
    as return_assistant_tokens_mask made transformers raise an error that named no field, and
    `self` a TypeError."""
    import inspect

    from transformers import PreTrainedTokenizerBase

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    named = {name for name, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    return frozenset(named) | {
        "self", "conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
        "return_dict", "tools", "documents", "chat_template",
    }  # fmt: skip


class Tokenizer:
    def __init__(self, hf_tokenizer: Any) -> None:
        """The special tokens a text prompt gets (BOS, EOS) are the post-processor's: an HF
        directory's tokenizer.json, a GGUF's add_bos_token / add_eos_token (tokenizer_loader)."""
        self.hf = hf_tokenizer
        self.backend = hf_tokenizer.backend_tokenizer
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.all_special_ids = frozenset(hf_tokenizer.all_special_ids)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token's text, in characters: a prompt longer than max_model_len times
        this can never fit, so it is refused before tokenizing."""
        return max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _RELEASE_GIL_CHARS:  # encode_batch releases the GIL; encode holds it
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def _byte_level(self) -> dict[str, int] | None:
        """GPT-2 byte-level BPE's char -> byte table, when this vocabulary is byte-level."""
        decoder = json.loads(self.backend.to_str()).get("decoder") or {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", [])}
        if "ByteLevel" not in kinds:
            return None
        printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
        table, extra = {chr(b): b for b in printable}, 0
        for b in range(256):
            if b not in printable:
                table[chr(256 + extra)] = b
                extra += 1
        return table

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one tokenizer per process, lives as long
    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (logprobs' `bytes`): part of a multi-byte character is its
        bytes, not the U+FFFD its text alone decodes to."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self.all_special_ids:
            return piece.encode()
        table = self._byte_level
        if table is not None and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        m = _BYTE_TOKEN.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render messages with the model's own chat template."""
        if not self.hf.chat_template:
            raise ValueError("messages: this model has no chat template")
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
