"""Masks the logits of a step's constrained rows: one bitmask fill + one in-place apply.

Called once per step by the engine's sampler before sampling (rows sampled on the device get
theirs from `fill_grammar_bitmask` when the step is sent: executor/device_sampling.py). Rows
without a grammar are left untouched, so unconstrained requests sample exactly as before.
"""

from __future__ import annotations

import torch

from kvserve.request import Request

_bitmask: torch.Tensor | None = None  # one buffer, reused across steps; grows to the largest batch seen


def _reused_bitmask(rows: int, vocab: int) -> torch.Tensor:
    """The buffer, made outside inference mode: the driver sampler fills it under
    torch.inference_mode, the step's sender (device sampling) outside it, and an inference
    tensor refuses in-place writes there (a JSON row's mask clearing failed the step)."""
    import xgrammar as xgr

    global _bitmask
    width = xgr.get_bitmask_shape(1, vocab)[1]
    if _bitmask is None or _bitmask.shape[0] < rows or _bitmask.shape[1] != width:
        with torch.inference_mode(False):
            _bitmask = xgr.allocate_token_bitmask(rows, vocab)
    return _bitmask[:rows]


def _allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    """Whether the filled mask row allows the token (checked before asking the matcher,
    which logs a warning for every special token it refuses)."""
    return 0 <= token < bitmask.shape[1] * 32 and bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def apply_grammar_bitmask(logits: torch.Tensor, reqs: list[Request]) -> None:
    """logits[i] belongs to reqs[i]; disallowed tokens of constrained rows become -inf."""
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if not rows:
        return
    import xgrammar as xgr

    vocab = logits.shape[-1]
    bitmask = _reused_bitmask(len(reqs), vocab)
    for i in rows:
        reqs[i].grammar.fill_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)


def fill_grammar_bitmask(reqs: list[Request], vocab: int) -> bytes:
    """The constrained requests' bitmasks, row i for reqs[i] (int32 [len(reqs), words] as raw
    bytes, copied out of the reused buffer), for a sampler that applies them elsewhere
    (sampling on the device)."""
    bitmask = _reused_bitmask(len(reqs), vocab)
    for i, req in enumerate(reqs):
        req.grammar.fill_bitmask(bitmask, i)
    return bitmask.numpy().tobytes()


def apply_grammar_bitmask_to_drafts(logits: torch.Tensor, req: Request, drafts: list[int]) -> None:
    """Mask the k + 1 verification rows of a constrained speculative request: row j allows
    what the grammar allows after drafts[:j]. The matcher advances over the drafts to fill
    each row and is rolled back afterwards (Scheduler.update advances it over the tokens that
    are actually emitted). A draft the grammar refuses is masked out in its own row, so it is
    always rejected; the rows after it cannot be reached and repeat that row's mask. So do the
    rows after a draft that ends the grammar (its stop token): the matcher has no next mask."""
    import xgrammar as xgr

    vocab = logits.shape[-1]
    bitmask = _reused_bitmask(len(drafts) + 1, vocab)
    grammar = req.grammar
    advanced = 0
    for j in range(len(drafts) + 1):
        if j and grammar.is_terminated():  # the request ends at the draft before: this row is unused
            bitmask[j] = bitmask[j - 1]
            continue
        grammar.fill_bitmask(bitmask, j)
        if (
            j == advanced < len(drafts)
            and _allowed(bitmask, j, drafts[j])
            and grammar.accept_tokens([drafts[j]])
        ):
            advanced += 1
    grammar.rollback(advanced)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
