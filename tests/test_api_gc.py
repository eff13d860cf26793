"""The API process freezes its start-up heap once ready (gc_freeze.py): a full collection then
walks only what requests made, not the ~260,000 objects of the imports and the tokenizer."""

from __future__ import annotations

import asyncio
import gc

from kvserve.config import EngineConfig
from kvserve.engine.async_llm import AsyncLLM
from kvserve.entrypoints.openai.lifecycle import Lifecycle


def test_the_startup_heap_is_frozen_when_the_server_turns_ready(tiny_llama_dir):
    engine = AsyncLLM(EngineConfig(model=tiny_llama_dir, kv_cache_memory="8MiB", max_model_len=256))
    life = Lifecycle(engine, shutdown_timeout=1)
    gc.unfreeze()
    try:

        async def start() -> None:
            engine.start()
            await life.warm_up()

        asyncio.run(start())
        assert life.ready
        assert gc.get_freeze_count() > 10_000, gc.get_freeze_count()  # torch alone is more
    finally:
        gc.unfreeze()  # the other tests' collector as it was
        engine.shutdown()
