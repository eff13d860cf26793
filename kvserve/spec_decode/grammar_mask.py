"""The draft model's guesses kept inside each constrained request's grammar.

An unconstrained draft proposes what the grammar forbids (on a random model nearly always), and
the proposal is cut there (EngineCore._propose), so a constrained request would get almost no
drafts. Masking the draft's logits, round by round, with what the grammar allows after the
drafts so far makes them guesses the target can accept. Each matcher advances over its drafts
while they are made and is rolled back after (Scheduler.update advances it over what is emitted).
"""

from __future__ import annotations

import torch

from kvserve.structured.state import GrammarState


class DraftGrammarMask:
    def __init__(self, grammars: dict[str, GrammarState]) -> None:
        self.grammars = grammars
        self.advanced = dict.fromkeys(grammars, 0)
        self.done: set[str] = set()  # the grammar ended or refused a draft: no more masking

    def __call__(self, rids: list[str], drafts: dict[str, list[int]], logits: torch.Tensor) -> None:
        """Mask logits[i] (request rids[i]) to what its grammar allows after its drafts so far."""
        import xgrammar as xgr

        rows = []
        for i, rid in enumerate(rids):
            grammar = self.grammars.get(rid)
            if grammar is None or rid in self.done:
                continue
            made = drafts[rid]
            if len(made) > self.advanced[rid]:  # the draft the previous round chose
                if not grammar.valid_prefix(made[-1:]) or not grammar.accept_tokens(made[-1:]):
                    self.done.add(rid)
                    continue
                self.advanced[rid] += 1
                if grammar.is_terminated():
                    self.done.add(rid)
                    continue
            rows.append((i, grammar))
        if not rows:
            return
        vocab = logits.shape[-1]
        bitmask = xgr.allocate_token_bitmask(len(rids), vocab)
        for i, grammar in rows:
            grammar.fill_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device), vocab_size=vocab, indices=[i for i, _ in rows]
        )

    def rollback(self) -> None:
        for rid, n in self.advanced.items():
            self.grammars[rid].rollback(n)
