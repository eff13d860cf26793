"""The API server's engine client: tokenizes and detokenizes here, runs the core elsewhere.

`generate()` returns an async stream of RequestOutputs for one request. One background task
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
from collections.abc import AsyncIterator, Sequence

import msgspec
import zmq
import zmq.asyncio

from kvserve.config import EngineConfig
from kvserve.engine.core_proc import AbortRequests, AddRequest, Failed, OutputMessage, Ready, run_engine_core
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
        self._out_sync = self._ctx.socket(zmq.PULL)
        self._out_sync.bind(self._out_addr)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(OutputMessage)
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(config, self._in_addr, self._out_addr), name="kvserve-engine-core"
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
        self._queues: dict[str, asyncio.Queue] = {}
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
            outs, to_abort = self.output_processor.process(msg.outputs)
            if to_abort:
                await self._send(AbortRequests(to_abort))
            for out in outs:
                q = self._queues.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)
            if self.on_step is not None:
                self.on_step(msg, outs)

    async def _watch_core(self) -> None:
        while self.proc.is_alive():
            await asyncio.sleep(0.1)
        self.dead = True
        logger.error(
            "engine core process died (exit code %s); failing in-flight requests", self.proc.exitcode
        )
        for q in self._queues.values():
            q.put_nowait(EngineDeadError("the engine core process died"))

    async def _send(self, msg) -> None:
        await self._in.send(self._encoder.encode(msg))

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs for one request. Raises ValueError for bad input (nothing is queued)."""
        if not self.is_alive:
            raise EngineDeadError("the engine core is not running")
        request_id = request_id or uuid.uuid4().hex
        req = self.processor.process(request_id, prompt, params)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self.output_processor.add_request(req, prompt if isinstance(prompt, str) else None)
        finished = False
        try:
            await self._send(AddRequest(req))
            while True:
                out = await q.get()
                if isinstance(out, Exception):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # client went away, timed out, or the engine died
                self.output_processor.abort(request_id)
                if self.is_alive:
                    await self._send(AbortRequests([request_id]))

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
