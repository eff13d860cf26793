"""The engine's view of a tokenizer: encode, decode, chat template, special ids.

Wraps a transformers fast tokenizer (for chat templates) and exposes its `tokenizers`
backend for incremental detokenization.
"""

from __future__ import annotations

import functools
from typing import Any

_RELEASE_GIL_CHARS = 4096  # longer texts are encoded without holding the GIL (server threads)


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, add_bos: bool = False) -> None:
        self.hf = hf_tokenizer
        self.backend = hf_tokenizer.backend_tokenizer
        self.add_bos = add_bos
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
            ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render messages with the model's own chat template."""
        if not self.hf.chat_template:
            raise ValueError("messages: this model has no chat template")
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
