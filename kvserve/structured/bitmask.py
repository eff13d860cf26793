"""Masks the logits of a step's constrained rows: one bitmask fill + one in-place apply.

Called once per step by the model runner before sampling. Rows without a grammar are left
untouched, so unconstrained requests sample exactly as before.
"""

from __future__ import annotations

import torch

from kvserve.request import Request

_bitmask: torch.Tensor | None = None  # reused across steps; grows to the largest batch seen


def apply_grammar_bitmask(logits: torch.Tensor, reqs: list[Request]) -> None:
    """logits[i] belongs to reqs[i]; disallowed tokens of constrained rows become -inf."""
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if not rows:
        return
    import xgrammar as xgr

    global _bitmask
    vocab = logits.shape[-1]
    width = xgr.get_bitmask_shape(1, vocab)[1]
    if _bitmask is None or _bitmask.shape[0] < len(reqs) or _bitmask.shape[1] != width:
        _bitmask = xgr.allocate_token_bitmask(len(reqs), vocab)
    for i in rows:
        reqs[i].grammar.fill_bitmask(_bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, _bitmask[: len(reqs)], vocab_size=vocab, indices=rows)
