"""One request's grammar matcher: which tokens may come next, and advancing over chosen ones.

Built from a compiled grammar once compilation finishes. `rollback` undoes accepted tokens,
so speculative decoding can advance over draft tokens and undo the rejected ones.
"""

from __future__ import annotations

import logging

import torch

from kvserve.structured.json_controls import control_tokens, keep_mask

logger = logging.getLogger(__name__)


class GrammarState:
    def __init__(self, compiled_grammar, request_id: str = "", json_text: bool = False) -> None:
        """`json_text`: the grammar is a JSON one, whose output never holds a raw control
        character (json_controls.py: xgrammar lets some through)."""
        import xgrammar as xgr

        self.request_id = request_id
        self.matcher = xgr.GrammarMatcher(
            compiled_grammar
        )  # xgrammar 0.2 keeps all history: rollback is unbounded
        self.num_accepted = 0
        self.failed = False  # a token the grammar refuses was sampled (should not happen)
        self._compiled = compiled_grammar
        self._special: frozenset[int] | None = None  # refused with a logged warning: not asked
        self._json = json_text
        self._keep: torch.Tensor | None = None  # json_text: the mask's words with control tokens cleared

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over all of token_ids, or over none of them (returns False, state unchanged)."""
        for i, tok in enumerate(token_ids):
            if self.matcher.is_terminated() or not self.matcher.accept_token(tok):
                if i:
                    self.matcher.rollback(i)
                return False
        self.num_accepted += len(token_ids)
        return True

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading tokens the grammar would accept next (the state is left as it was):
        a speculative proposal is cut there, since verification rejects the rest anyway."""
        if self._special is None:  # padding ids past the tokenizer's, control tokens (xgrammar's)
            info = self._compiled.tokenizer_info
            self._special = frozenset(info.special_token_ids) - frozenset(info.stop_token_ids)
            if self._json:
                self._special |= frozenset(control_tokens(info))
        n = 0
        for tok in token_ids:
            if tok in self._special or self.matcher.is_terminated() or not self.matcher.accept_token(tok):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    def accept_sampled(self, token_id: int) -> None:
        """Advance over a sampled token; a refused one ends the request (logged)."""
        if not self.accept_tokens([token_id]):
            logger.warning(
                "request %s: grammar refused sampled token %d; ending it", self.request_id, token_id
            )
            self.failed = True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens
            self.failed = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-next-token bits into bitmask[row] (int32, 32 tokens per word)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self._json:
            if self._keep is None or self._keep.numel() != bitmask.shape[-1]:
                self._keep = keep_mask(self._compiled.tokenizer_info, bitmask.shape[-1])
            bitmask[row] &= self._keep.to(bitmask.device)

    def may_end(self) -> bool:
        """Whether the text so far is complete for the grammar (its stop token would be accepted)."""
        return self.matcher.is_completed()

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted, or it refused a token."""
        return self.failed or self.matcher.is_terminated()
