"""Rows a request's own masks leave with no token to sample, and what to tell its client.

allowed_token_ids and bad_words (vLLM's extras) take tokens out of a row that a grammar has
already masked. Where nothing is left, every logit is -inf and the argmax was token 0: the
grammar refused it, and the request ended "stop" with empty text and a logged warning, as if
the model had chosen to stop. Such a row is sampled as NO_TOKEN instead; the scheduler ends
the request "stop" where the grammar is complete (only its end, which allowed_token_ids left
out, was allowed), else as the client's error, naming the field.
"""

from __future__ import annotations

import torch

NO_TOKEN = -1
"""The token of a row with nothing left to sample (never appended to the output)."""


def empty_rows(logits: torch.Tensor, reqs: list) -> list[int]:
    """The rows among those whose masks take tokens out (allowed_token_ids, bad_words) where
    every logit is -inf."""
    rows = [i for i, r in enumerate(reqs) if r.params.masks_tokens]
    if not rows:
        return []
    empty = torch.isneginf(logits[torch.tensor(rows)]).all(-1)
    return [rows[j] for j in empty.nonzero().flatten().tolist()]


def no_token_error(req) -> str:
    """Why nothing could be sampled, led by the field the client set (its 400's param)."""
    where = f"at output token {len(req.output_token_ids)}"
    p = req.params
    if req.grammar is not None and p.allowed_token_ids is not None:
        return (
            f"allowed_token_ids: none of them is a token the structured output's constraint allows {where}; "
            "allow the tokens the constraint needs, or leave allowed_token_ids out"
        )
    if req.grammar is not None:
        return f"bad_words: they ban every token the structured output's constraint allows {where}"
    return f"bad_words: they ban every token allowed_token_ids allows {where}"
