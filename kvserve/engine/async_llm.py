"""The API server's engine client: tokenizes and detokenizes here, runs the core elsewhere.

`add_request()` returns an async stream of RequestOutputs for one request. One background task
reads the core's per-step outputs, turns them into text (stop strings included) and hands
them to each request's queue; another watches the core process, so if it dies every
in-flight request fails at once and `is_alive` turns false.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import tempfile
import time
import uuid
from collections.abc import Sequence

import msgspec
import zmq
import zmq.asyncio

from kvserve.config import EngineConfig
from kvserve.engine.core_proc import (
    AbortRequests,
    AddRequest,
    Failed,
    OutputMessage,
    Ready,
    ResetPrefixCache,
    run_engine_core,
)
from kvserve.engine.messages import EngineCoreOutputs
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.processor import InputProcessor, ModelLimits
from kvserve.model.loader import load_tokenizer, resolve_model
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core process is gone; requests cannot be served."""


class EngineStats:
    """Latest scheduler numbers reported by the core (for /metrics)."""

    num_running = 0
    num_waiting = 0
    kv_cache_usage = 0.0
    num_preemptions_total = 0
    prefix_cache_queries = 0
    prefix_cache_hits = 0


_CLOSED = object()


class RequestStream:
    """One request's outputs as an async iterator; closing it early aborts the request."""

    def __init__(self, engine: AsyncLLM, request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.started = False  # has produced output
        self.finished = False

    def put(self, item: RequestOutput | Exception) -> None:
        self.started = True
        if isinstance(item, Exception) or item.finished:
            self.finished = True
            self.engine._drop(self.request_id)  # delivered even if nobody reads the stream
        self.queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished and self.queue.empty():
            raise StopAsyncIteration
        item = await self.queue.get()
        if item is _CLOSED:
            raise StopAsyncIteration
        if isinstance(item, Exception):
            raise item
        return item

    async def aclose(self) -> None:
        """Abort the request if it has not finished (client gone, timeout)."""
        if self.finished:
            return
        self.finished = True
        self.queue.put_nowait(_CLOSED)  # wakes a reader waiting on this stream
        self.engine._drop(self.request_id)
        self.engine.output_processor.abort(self.request_id)
        if self.engine.is_alive:
            await self.engine._send(AbortRequests([self.request_id]))


class AsyncLLM:
    def __init__(self, config: EngineConfig, startup_timeout: float = 300.0) -> None:
        self.config = config
        self.source = resolve_model(config.model)
        self.tokenizer = load_tokenizer(self.source)
        base = os.path.join(tempfile.gettempdir(), f"kvserve-{uuid.uuid4().hex[:12]}")
        self._in_addr, self._out_addr = f"ipc://{base}-in", f"ipc://{base}-out"
        self._ctx = zmq.Context()
        self._in_sync = self._ctx.socket(zmq.PUSH)
        self._in_sync.bind(self._in_addr)
        self._in_sync.setsockopt(zmq.SNDHWM, 0)  # never drop or block a request on a full queue
        self._out_sync = self._ctx.socket(zmq.PULL)
        self._out_sync.bind(self._out_addr)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(OutputMessage)
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(config, self._in_addr, self._out_addr),
            name="kvserve-engine-core",
            daemon=True,  # also terminated by multiprocessing when this process exits normally
        )
        self.proc.start()
        self.ready = self._wait_ready(startup_timeout)
        self.limits = ModelLimits(
            self.ready.vocab_size, self.ready.max_model_len, self.ready.num_blocks, self.ready.block_size
        )
        self.processor = InputProcessor(self.tokenizer, self.limits)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats = EngineStats()
        self.dead = False
        self._streams: dict[str, RequestStream] = {}
        self._tasks: list[asyncio.Task] = []
        self.on_step = None  # callback(EngineCoreOutputs, list[RequestOutput]) for metrics

    def _wait_ready(self, timeout: float) -> Ready:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.proc.is_alive():
                raise RuntimeError(f"engine core exited during start-up (code {self.proc.exitcode})")
            if self._out_sync.poll(500):
                msg = self._decoder.decode(self._out_sync.recv())
                if isinstance(msg, Failed):
                    self.proc.join(5)
                    raise ValueError(msg.error)
                if isinstance(msg, Ready):
                    return msg
        self.proc.kill()
        raise TimeoutError("engine core did not start in time")

    @property
    def is_alive(self) -> bool:
        return not self.dead and self.proc.is_alive()

    def start(self) -> None:
        """Start the background tasks; call from inside the server's event loop."""
        self._in = zmq.asyncio.Socket.shadow(self._in_sync.underlying)
        self._out = zmq.asyncio.Socket.shadow(self._out_sync.underlying)
        self._tasks = [asyncio.create_task(self._output_loop()), asyncio.create_task(self._watch_core())]

    async def _output_loop(self) -> None:
        while True:
            msg = self._decoder.decode(await self._out.recv())
            if not isinstance(msg, EngineCoreOutputs):
                continue
            s = self.stats
            s.num_running, s.num_waiting = msg.num_running, msg.num_waiting
            s.kv_cache_usage, s.num_preemptions_total = msg.kv_cache_usage, msg.num_preemptions_total
            s.prefix_cache_queries, s.prefix_cache_hits = msg.prefix_cache_queries, msg.prefix_cache_hits
            outs, to_abort = self.output_processor.process(msg.outputs)
            if to_abort:
                await self._send(AbortRequests(to_abort))
            for out in outs:
                st = self._streams.get(out.request_id)
                if st is not None:
                    st.put(out)
            if self.on_step is not None:
                self.on_step(msg, outs)

    async def _watch_core(self) -> None:
        while self.proc.is_alive():
            await asyncio.sleep(0.1)
        self.dead = True
        logger.error(
            "engine core process died (exit code %s); failing in-flight requests", self.proc.exitcode
        )
        for st in list(self._streams.values()):
            st.put(EngineDeadError("the engine core process died"))

    async def _send(self, msg) -> None:
        await self._in.send(self._encoder.encode(msg))

    @property
    def num_waiting(self) -> int:
        """Requests accepted here that have not produced a token yet (queued or prefilling)."""
        return sum(1 for st in self._streams.values() if not st.started)

    async def reset_prefix_cache(self) -> None:
        await self._send(ResetPrefixCache())

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        group_id: str | None = None,
    ) -> RequestStream:
        """Queue a request now (synchronously) and return its output stream.

        Raises ValueError for bad input (nothing is queued). The request runs even if the
        stream is never read; it is aborted when the stream is closed before it finishes.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine core is not running")
        request_id = request_id or uuid.uuid4().hex
        req = self.processor.process(request_id, prompt, params, None, priority, cache_salt, group_id)
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        self.output_processor.add_request(req, prompt if isinstance(prompt, str) else None)
        self._in_sync.send(self._encoder.encode(AddRequest(req)), zmq.NOBLOCK)
        return stream

    def _drop(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
        self._in_sync.close(linger=0)
        self._out_sync.close(linger=0)
        self._ctx.term()
        for addr in (self._in_addr, self._out_addr):
            try:
                os.unlink(addr[len("ipc://") :])
            except OSError:
                pass
