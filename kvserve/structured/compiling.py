"""Requests whose grammar is still compiling: held beside the scheduler, not inside it.

A constrained request enters the scheduler only once its grammar is compiled, so the
scheduler never sees an unready request and every other request keeps running meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait

from kvserve.request import Request
from kvserve.structured.backend import GrammarCompiler
from kvserve.structured.spec import grammar_key
from kvserve.structured.state import GrammarState
from kvserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class CompilingRequests:
    def __init__(
        self, tokenizer: Callable[[], Tokenizer], vocab_size: int, stop_token_ids: frozenset[int]
    ) -> None:
        self._args = (tokenizer, vocab_size, sorted(stop_token_ids))
        self._compiler: GrammarCompiler | None = None  # built on first use (xgrammar import)
        self._pending: dict[str, tuple[Request, Future]] = {}

    def add(self, req: Request) -> None:
        self._pending[req.request_id] = (
            req,
            self._grammar_compiler().submit(grammar_key(req.params.structured_outputs)),
        )

    def warm(self) -> Future:
        """Get the compiler ready off the step loop (see GrammarCompiler.warm); a failure
        there surfaces again, as a failed compilation, on the first grammar."""
        return self._grammar_compiler().warm()

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(*self._args)
        return self._compiler

    def pop_ready(self) -> tuple[list[Request], list[Request]]:
        """(requests now holding their GrammarState, requests whose compilation failed)."""
        ready, failed = [], []
        for rid, (req, fut) in list(self._pending.items()):
            if not fut.done():
                continue
            del self._pending[rid]
            if fut.exception() is not None:
                logger.error("request %s: grammar compilation failed: %s", rid, fut.exception())
                failed.append(req)
            else:
                kind = grammar_key(req.params.structured_outputs)[0]
                req.grammar = GrammarState(fut.result(), rid, json_text=kind in ("json", "json_object"))
                ready.append(req)
        return ready, failed

    def abort(self, request_id: str) -> Request | None:
        """The request, no longer waiting for its grammar; None if it was not."""
        held = self._pending.pop(request_id, None)
        return None if held is None else held[0]

    def wait(self, timeout: float) -> None:
        """Block (GIL released) until a compilation finishes or timeout; for an otherwise idle engine."""
        wait([f for _, f in self._pending.values()], timeout, return_when=FIRST_COMPLETED)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending

    def __len__(self) -> int:
        return len(self._pending)
