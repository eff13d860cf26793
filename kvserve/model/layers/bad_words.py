"""vLLM's `bad_words` as token sequences, and the tokens they ban at a step.

A word is tokenized alone and, when that gives another first token in as many tokens, after a
space too (its spelling inside a sentence for byte-level BPE vocabularies), as vLLM does. A
word's last token is banned wherever the output so far ends with its other tokens: a one-token
word is never generated, a longer one is cut off before its end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.tokenizer import Tokenizer


def bad_words_token_ids(tokenizer: Tokenizer, words: Sequence[str]) -> list[list[int]]:
    """The token sequences to ban for `words` (each at least one token)."""
    sequences: list[list[int]] = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(alone)
        if len(spaced) == len(alone) and spaced[0] != alone[0]:
            sequences.append(spaced)
    return sequences


def banned_tokens(sequences: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The last tokens of the sequences whose other tokens end `output`."""
    banned = []
    for seq in sequences:
        prefix = len(seq) - 1
        if prefix == 0 or (prefix <= len(output) and list(output[len(output) - prefix :]) == list(seq[:-1])):
            banned.append(seq[-1])
    return banned
