"""Draft-model proposer: a smaller model that shares the target's tokenizer guesses the next
k tokens greedily. Its KV lives in the model runner (same block tables as the target, its
own tensor), so this class only decides how far each request may look ahead: the draft
writes KV for positions num_tokens - 1 onwards, which must be slots the request holds. A
constrained request's draft guesses within its grammar (grammar_mask.py)."""

from __future__ import annotations

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.request import Request
from kvserve.spec_decode.grammar_mask import DraftGrammarMask
from kvserve.worker.model_runner import ModelRunner


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager) -> None:
        self.runner = runner
        self.kv = kv

    def propose(self, items: list[tuple[Request, int]]) -> dict[str, list[int]]:
        tables = {r.request_id: self.kv.get_block_ids(r.request_id) for r, _ in items}
        capped = []
        for req, k in items:
            room = len(tables[req.request_id]) * self.kv.block_size - (req.num_tokens - 1)
            if min(k, room) > 0:
                capped.append((req.request_id, req.all_token_ids[-1], req.num_tokens, min(k, room)))
        if not capped:
            return {}
        grammars = {r.request_id: r.grammar for r, _ in items if r.grammar is not None}
        mask = DraftGrammarMask(grammars) if grammars else None
        try:
            return self.runner.propose_with_draft(capped, tables, mask)
        finally:
            if mask is not None:
                mask.rollback()
