"""Compiles grammars against the model's vocabulary, off the step loop, with a cache.

xgrammar's compilation (a token mask per grammar state) takes milliseconds for a small
schema and seconds for a large one; it releases the GIL, so it runs in a worker thread
while the engine keeps stepping other requests. Equal specs share one compilation (the
cache holds futures, so concurrent requests for the same schema wait on the same one).
A large spec compiles in its own lane: with one thread for all, a schema of 2,000
properties (12 s on a 512-token vocabulary, far longer on a real one) held every small
schema's request behind it.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from kvserve.structured.json_patterns import regex_grammar
from kvserve.structured.json_strings import json_schema_grammar
from kvserve.structured.regex_flavour import for_xgrammar
from kvserve.structured.spec import GrammarKey
from kvserve.tokenizer import Tokenizer

CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first)."""
LARGE_SPEC = 16 * 1024
"""A spec's text from this many characters compiles in the large lane (a schema of a few dozen
properties compiles in well under a second; one of this size takes seconds)."""


class GrammarCompiler:
    def __init__(
        self, tokenizer: Callable[[], Tokenizer], vocab_size: int, stop_token_ids: list[int]
    ) -> None:
        self.tokenizer = tokenizer  # called in the compile thread: the core builds it on first use
        self.vocab_size = vocab_size  # the model's (logits width), may exceed the tokenizer's
        self.stop_token_ids = sorted(stop_token_ids)
        low = _lower_thread_priority
        self._pools = {
            lane: ThreadPoolExecutor(1, thread_name_prefix=f"grammar-compile-{lane}", initializer=low)
            for lane in ("small", "large")
        }
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._compilers: dict[str, object] = {}  # one xgrammar compiler a lane, built in its thread
        self._lock = threading.Lock()

    def submit(self, key: GrammarKey) -> Future:
        """A future of the CompiledGrammar for this key (shared with earlier equal keys)."""
        fut = self._cache.get(key)
        if fut is not None and not (fut.done() and fut.exception() is not None):
            self._cache.move_to_end(key)
            return fut
        lane = "large" if len(key[1]) >= LARGE_SPEC else "small"
        fut = self._pools[lane].submit(self._compile, key, lane)
        self._cache[key] = fut
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return fut

    def warm(self) -> Future:
        """Build the small lane's xgrammar compiler (and with it the tokenizer) in its thread
        now, for an idle engine: the first grammar then waits for none of it."""
        return self._pools["small"].submit(self._xgr_compiler, "small")

    def _xgr_compiler(self, lane: str):
        import xgrammar as xgr

        with self._lock:
            if lane not in self._compilers:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer().hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                # Our own cache (above) dedupes; xgrammar's would keep a second copy.
                self._compilers[lane] = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compilers[lane]

    def _compile(self, key: GrammarKey, lane: str = "small"):
        kind, text = key
        c = self._xgr_compiler(lane)
        if kind == "json":  # length-bounded strings rewritten to hold escapes (json_strings.py)
            return c.compile_grammar(json_schema_grammar(text))
        if kind == "json_object":  # xgrammar's builtin JSON grammar also allows a top-level array
            return c.compile_grammar(json_schema_grammar('{"type": "object"}'))
        if kind == "regex":  # classes without surrogates (json_patterns.py); as xgrammar has it else
            try:
                return c.compile_grammar(regex_grammar(text))
            except (RuntimeError, ValueError, IndexError):
                return c.compile_regex(for_xgrammar(text, python=True))  # read as Python's re reads it
        return c.compile_grammar(text)

    def shutdown(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)


def _lower_thread_priority() -> None:
    """Let the step loop win the CPU when cores are few: on Linux a thread has its own nice
    value, so only the compile thread is deprioritised and compiles in the leftover time."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 5)
    except (AttributeError, OSError):
        pass
