"""Tokens holding a raw control character (U+0000-U+001F), which no JSON output may contain.

JSON allows them only escaped inside strings and, unescaped, only tab / newline / carriage return
as whitespace, which kvserve's JSON grammars (compiled without `any_whitespace`) never emit.
xgrammar 0.2.8 writes a string with minLength / maxLength as any character but a quote, a backslash,
CR or LF, m to n times, so such tokens passed its mask there and a request got text json.loads
refuses. json_strings.py now rewrites those strings; a JSON request's mask still has them cleared
(state.GrammarState), whatever grammar xgrammar writes."""

from __future__ import annotations

import threading

import numpy as np
import torch

_lock = threading.Lock()
_masks: dict[int, tuple[object, list[int]]] = {}  # id(TokenizerInfo) -> (it, token ids)


def control_tokens(info) -> list[int]:
    """Ids of the tokens (of xgrammar's TokenizerInfo) whose bytes hold a byte below 0x20."""
    with _lock:
        hit = _masks.get(id(info))
        if hit is None:
            ids = [i for i, b in enumerate(info.decoded_vocab) if any(c < 0x20 for c in bytes(b))]
            hit = _masks[id(info)] = (info, ids)  # the info kept alive: its id stays its own
        return hit[1]


def keep_mask(info, words: int) -> torch.Tensor:
    """An int32 bitmask of `words` words, every bit set except the control tokens'."""
    bits = np.full(words, 0xFFFFFFFF, dtype=np.uint32)
    for t in control_tokens(info):
        if t // 32 < words:
            bits[t // 32] &= ~np.uint32(1 << (t % 32))
    return torch.from_numpy(bits.view(np.int32))
