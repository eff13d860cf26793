"""The API server's engine client: tokenizes and detokenizes here, runs the core elsewhere.

`add_request()` returns an async stream of RequestOutputs for one request. A reader on the
event loop takes the core's per-step outputs, turns them into text (stop strings included) and
hands them to each request's queue; a background task watches the core process, so if it dies
every in-flight request fails at once and `is_alive` turns false.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import time
import uuid
from collections.abc import Sequence
from multiprocessing.process import BaseProcess

import msgspec
import zmq
import zmq.asyncio

from kvserve.config import EngineConfig
from kvserve.engine.core_prespawn import PrespawnedCore, core_addresses
from kvserve.engine.core_proc import (
    AbortRequests,
    AddRequest,
    Failed,
    OutputMessage,
    Ready,
    ResetPrefixCache,
    run_engine_core,
)
from kvserve.engine.group_load import GroupLeaders
from kvserve.engine.messages import EngineCoreOutputs
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.processor import InputProcessor, ModelLimits
from kvserve.kv_transfer.params import remote_tokens
from kvserve.model.loader import load_tokenizer, resolve_model, resolve_tokenizer
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core is not running; requests cannot be served (503). `retry_after` is set
    while the supervisor is restarting it."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestFailedError(RuntimeError):
    """The engine failed while running this request; the others went on (500)."""


class RequestRefusedError(RequestFailedError, ValueError):
    """The request's own parameters left the engine nothing to do at some step (allowed_token_ids
    that the structured output's grammar refuses: model/layers/empty_rows.py): the client's
    error, a 400 naming the field its message starts with; handled as a failed request where a
    caller knows no better (a stream's error event)."""


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
        self.prefill_tokens = 0  # prompt tokens it is expected to compute (a router's load)
        self.group_id: str | None = None  # its n-sample group (engine/group_load.py)
        self.background = False  # a batch line (set by the server): outside the waiting room

    def put(self, item: RequestOutput | Exception) -> None:
        self.started = True
        if isinstance(item, Exception) or item.finished:
            self.finished = True
            self.engine._drop(self.request_id)  # delivered even if nobody reads the stream
        self.queue.put_nowait(item)

    def interrupt(self, error: Exception) -> None:
        """Make the reader raise `error` (a timeout); the request stays live until the stream
        is closed, which aborts it in the core."""
        if not self.finished:
            self.queue.put_nowait(error)

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
        out = self.engine.output_processor.abort(self.request_id)
        if out is not None and self.engine.on_abort is not None:
            self.engine.on_abort(out)  # ended here: the core sends nothing more for it
        if self.engine.is_alive:
            await self.engine._send(AbortRequests([self.request_id]))


class AsyncLLM:
    """The API side of the engine, and the supervisor of its core process: when the core dies
    (OOM killer, segfault), in-flight requests fail at once and the core is restarted with
    back-off, up to `restart_limit` times in a row (a core that stays up for
    `RESTART_RESET_S` earns its count back)."""

    RESTART_RESET_S = 300.0

    def __init__(
        self,
        config: EngineConfig,
        startup_timeout: float = 300.0,
        restart_limit: int = 3,
        num_threads: int | None = None,
        publish_kv_events: bool = False,
        wait: bool = True,
        prespawned: PrespawnedCore | None = None,
    ) -> None:
        """`wait=False` returns once the core is spawned (call `wait_started`): replicas load
        at the same time. Spawn from the main thread: the core's parent-death signal follows
        the thread that started it. `prespawned`: a process already importing the engine,
        started with this config and these options (engine/core_prespawn.py), used for the first
        core."""
        self.config = config
        self.num_threads, self.publish_kv_events = num_threads, publish_kv_events
        self.startup_timeout = startup_timeout
        self.restart_limit = restart_limit
        self.source = resolve_model(config.model)
        tokenizer_source = resolve_tokenizer(config.model, config.tokenizer)  # --tokenizer, or the model's
        self._ctx = zmq.Context()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(OutputMessage)
        taken = prespawned.take(config, num_threads, publish_kv_events) if prespawned is not None else None
        self._open_sockets(taken)
        self._spawn_core(prespawned.proc if taken else None)
        try:
            self.tokenizer = load_tokenizer(tokenizer_source)  # while the core starts (imports, weights)
        except BaseException:
            self.proc.kill()
            self._close_sockets()
            raise
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats = EngineStats()
        self.dead = False
        self.restarting = False
        self.num_restarts = 0  # in a row; see RESTART_RESET_S
        self._closed = False
        self._up_since = time.monotonic()
        self._streams: dict[str, RequestStream] = {}
        self._leaders = GroupLeaders()  # n-sample groups: who computes the prompt (load)
        self._out_fd: int | None = None  # the outputs socket's fd while a reader is on it
        self._watch_task: asyncio.Task | None = None
        self.on_step = None  # callback(EngineCoreOutputs, list[RequestOutput]) for metrics
        self.on_core_lost = None  # callback() when the core dies: clear what it reported
        self.on_abort = None  # callback(RequestOutput) for a request ended here (client gone, timeout)
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Block until the core has loaded the model (raises if it fails or times out)."""
        self.ready = self._wait_ready(self.startup_timeout)
        self.limits = ModelLimits(
            self.ready.vocab_size, self.ready.max_model_len, self.ready.num_blocks, self.ready.block_size
        )
        self.processor = InputProcessor(self.tokenizer, self.limits, self.config.kv_transfer)

    # ---- the core process and its sockets ---------------------------------------------------
    def _open_sockets(self, addresses: tuple[str, str] | None = None) -> None:
        """Fresh IPC addresses per core (`addresses`: a prespawned core's, which it has already
        connected to): nothing queued for a dead core reaches its successor."""
        self._in_addr, self._out_addr = addresses or core_addresses()
        self._in_sync = self._ctx.socket(zmq.PUSH)
        # No limit on requests queued for the core (one API request may fan out into thousands).
        # Before bind: the pipe to the core keeps the limit set when it was made, and past the
        # default 1,000 a send would fail as if the core were dead.
        self._in_sync.setsockopt(zmq.SNDHWM, 0)
        self._in_sync.bind(self._in_addr)
        self._out_sync = self._ctx.socket(zmq.PULL)
        self._out_sync.bind(self._out_addr)
        self._in = zmq.asyncio.Socket.shadow(self._in_sync.underlying)
        self._out = zmq.asyncio.Socket.shadow(self._out_sync.underlying)

    def _close_sockets(self) -> None:
        # The asyncio views first: closing them takes their fds off the event loop, so a new
        # socket that reuses an fd number is not left behind a stale reader.
        for sock in (self._in, self._out, self._in_sync, self._out_sync):
            sock.close(linger=0)
        for addr in (self._in_addr, self._out_addr):
            try:
                os.unlink(addr[len("ipc://") :])
            except OSError:
                pass

    def _spawn_core(self, prespawned: BaseProcess | None = None) -> None:
        """A new core process on the current addresses, or the prespawned one already on them."""
        if prespawned is not None:
            self.proc = prespawned
            return
        args = (self.config, self._in_addr, self._out_addr, self.num_threads, self.publish_kv_events)
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=args,
            name="kvserve-engine-core",
            daemon=True,  # also terminated by multiprocessing when this process exits normally
        )
        self.proc.start()

    def _ready_message(self, raw: bytes) -> Ready | None:
        msg = self._decoder.decode(raw)
        if isinstance(msg, Failed):
            self.proc.join(5)
            raise ValueError(msg.error)
        return msg if isinstance(msg, Ready) else None

    def _wait_ready(self, timeout: float) -> Ready:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.proc.is_alive():
                raise RuntimeError(f"engine core exited during start-up (code {self.proc.exitcode})")
            if self._out_sync.poll(500) and (ready := self._ready_message(self._out_sync.recv())):
                return ready
        self.proc.kill()
        raise TimeoutError("engine core did not start in time")

    async def _wait_ready_async(self, timeout: float) -> Ready:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.proc.is_alive():
                raise RuntimeError(f"engine core exited during start-up (code {self.proc.exitcode})")
            if await self._out.poll(200) and (ready := self._ready_message(await self._out.recv())):
                return ready
        self.proc.kill()
        raise TimeoutError("engine core did not start in time")

    @property
    def is_alive(self) -> bool:
        return not self.dead and self.proc.is_alive()

    def start(self) -> None:
        """Start reading the core's outputs and watching it; call from inside the server's
        event loop."""
        self._listen()
        self._watch_task = asyncio.create_task(self._supervise())

    def _listen(self) -> None:
        """Read the core's outputs in a callback on its socket's fd: one wake-up of the loop per
        step, no Future or task switch between the socket and the requests' queues (at one
        stream, the API process's CPU per token is taken from the engine's cores)."""
        self._loop = asyncio.get_running_loop()
        self._out_fd = self._out_sync.getsockopt(zmq.FD)
        self._loop.add_reader(self._out_fd, self._drain_outputs)
        self._drain_outputs()  # the fd signals changes only: read what came before

    def _unlisten(self) -> None:
        if self._out_fd is None:
            return
        if not self._loop.is_closed():
            self._loop.remove_reader(self._out_fd)
        self._out_fd = None

    def _drain_outputs(self) -> None:
        sock = self._out_sync
        # Until the socket says nothing is left (an empty recv's zmq.Again costs more than a
        # step's output handling).
        while self._out_fd is not None and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            raw = sock.recv(zmq.NOBLOCK)
            try:
                self._on_output(self._decoder.decode(raw))
            except Exception:  # a bug here must not leave the rest unread (the fd would not wake us)
                logger.exception("failed to handle an engine core output")

    def _on_output(self, msg: OutputMessage) -> None:
        if not isinstance(msg, EngineCoreOutputs):
            return
        s = self.stats
        s.num_running, s.num_waiting = msg.num_running, msg.num_waiting
        s.kv_cache_usage, s.num_preemptions_total = msg.kv_cache_usage, msg.num_preemptions_total
        s.prefix_cache_queries, s.prefix_cache_hits = msg.prefix_cache_queries, msg.prefix_cache_hits
        refused = {o.request_id for o in msg.outputs if o.refused}
        outs, to_abort = self.output_processor.process(msg.outputs)
        if to_abort:
            self._in_sync.send(self._encoder.encode(AbortRequests(to_abort)), zmq.NOBLOCK)
        for out in outs:
            st = self._streams.get(out.request_id)
            if st is None:
                continue
            c = out.outputs[0]
            if c.finish_reason == "error":
                failed = RequestRefusedError if out.request_id in refused else RequestFailedError
                st.put(failed(str(c.stop_reason)))
            else:
                st.put(out)
        if self.on_step is not None:
            self.on_step(msg, outs)

    async def _supervise(self) -> None:
        """Watch the core; when it dies, fail what was in flight and start a new one."""
        while not self._closed:
            while self.proc.is_alive():
                await asyncio.sleep(0.1)
            if self._closed:
                return
            self._core_lost()
            if time.monotonic() - self._up_since > self.RESTART_RESET_S:
                self.num_restarts = 0
            if self.num_restarts >= self.restart_limit:
                logger.error("engine core restart limit (%d) reached; not restarting", self.restart_limit)
                return
            self.restarting = True
            delay = min(0.5 * 2**self.num_restarts, 30.0)
            self.num_restarts += 1
            logger.warning("restarting the engine core in %.1fs (restart %d)", delay, self.num_restarts)
            await asyncio.sleep(delay)
            try:
                self._unlisten()
                self._close_sockets()
                self._open_sockets()
                self._spawn_core()
                await self._wait_ready_async(self.startup_timeout)
            except Exception as e:  # noqa: BLE001 - the next round of the loop retries or gives up
                logger.error("engine core restart failed: %s", e)
                if self.proc.is_alive():
                    self.proc.kill()
                continue
            self._listen()
            self._up_since = time.monotonic()
            self.dead = self.restarting = False
            logger.info("engine core restarted (pid %d)", self.proc.pid)

    def _core_lost(self) -> None:
        self.dead = True
        self._unlisten()
        logger.error(
            "engine core process died (exit code %s); failing %d in-flight request(s)",
            self.proc.exitcode, len(self._streams),
        )  # fmt: skip
        # The supervisor starts a new core unless its restart limit is reached (as it decides
        # next): then a retry is worth it, and the 503 says when, as dead_error does meanwhile.
        restarts = (
            time.monotonic() - self._up_since > self.RESTART_RESET_S or self.num_restarts < self.restart_limit
        )
        err = (
            EngineDeadError("the engine core process died; it is restarting, retry shortly", retry_after=5)
            if restarts
            else EngineDeadError("the engine core process died")
        )
        self._release_unasked_leases()
        for st in list(self._streams.values()):
            st.put(err)
        self._streams.clear()
        self._leaders.clear()
        self.output_processor.states.clear()
        self.stats = EngineStats()
        if self.on_core_lost is not None:
            self.on_core_lost()

    def _release_unasked_leases(self) -> None:
        """A kv_consumer's core that died took its connector with it: the producers' leases
        of requests that had not pulled their KV (no output yet) were held for nobody until
        lease_s. Released now; a lease already pulled is gone and its release a no-op."""
        for rid, st in self._streams.items():
            state = self.output_processor.states.get(rid)
            if not st.started and state is not None:
                self.processor.release_lease(state.params)

    def dead_error(self) -> EngineDeadError:
        if self.restarting:
            return EngineDeadError("the engine core is restarting; retry shortly", retry_after=5)
        return EngineDeadError("the engine core is not running")

    async def _send(self, msg) -> None:
        await self._in.send(self._encoder.encode(msg))

    @property
    def num_waiting(self) -> int:
        """Interactive requests accepted here that have not produced a token yet (queued or
        prefilling): what --max-waiting-requests bounds. Batch lines are not counted: the batch
        runner keeps at most its window of them in the engine, and they run only when nobody
        else is waiting, so they must not crowd interactive requests out of the waiting room."""
        return sum(1 for st in self._streams.values() if not (st.started or st.background))

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def waiting_prefill_tokens(self) -> int:
        """Prompt tokens still to compute for requests with no output yet (queued or
        prefilling): the scaling signal kvserve:num_waiting_prefill_tokens."""
        return sum(st.prefill_tokens for st in self._streams.values() if not st.started)

    @property
    def load_tokens(self) -> int:
        """Load in tokens: prompt tokens still to prefill + one per running sequence."""
        return sum(1 if st.started else st.prefill_tokens for st in self._streams.values())

    async def reset_prefix_cache(self) -> None:
        if not self.is_alive:
            raise self.dead_error()
        await self._send(ResetPrefixCache())

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        group_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        session: str | None = None,
    ) -> RequestStream:
        """Queue a request now (synchronously) and return its output stream.

        `prompt_token_ids`, if given, are the prompt already tokenized (the server tokenizes
        off the event loop); `session` only matters to a data-parallel router. Raises
        ValueError for bad input and EngineDeadError when the core is down; either way
        nothing is registered. The request runs even if the stream is never read; it is
        aborted when the stream is closed before it finishes.
        """
        if not self.is_alive:
            raise self.dead_error()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            held = self.output_processor.states.get(request_id)
            self.processor.release_lease(params, held.params if held is not None else None)
            raise ValueError(f"request_id: {request_id!r} is already in use")
        req = self.processor.process(
            request_id, prompt if prompt_token_ids is None else prompt_token_ids, params, None, priority,
            cache_salt, group_id,
        )  # fmt: skip
        try:
            payload = self._encoder.encode(AddRequest(req))
        except (OverflowError, TypeError, ValueError) as e:
            self.processor.release_lease(params)
            raise ValueError(f"request: a field is out of range ({e})") from None
        try:
            self._in_sync.send(payload, zmq.NOBLOCK)
        except zmq.ZMQError:
            self.processor.release_lease(params)
            raise self.dead_error() from None
        stream = RequestStream(self, request_id)
        stream.group_id = group_id
        ids = req.prompt_token_ids
        computed = len(ids) - remote_tokens(params.kv_transfer_params, len(ids))  # (the rest: a producer's)
        stream.prefill_tokens = self._leaders.prompt_tokens(
            request_id, group_id, params, computed, self._waiting
        )
        self._streams[request_id] = stream
        self.output_processor.add_request(req, prompt if isinstance(prompt, str) else None)
        return stream

    def fail_all(self, error: Exception) -> None:
        """End every in-flight request with `error` (their streams raise it) and abort them."""
        ids = list(self._streams)
        for rid in ids:
            self._streams[rid].put(error)
            self.output_processor.abort(rid)
        if ids and self.is_alive:
            self._in_sync.send(self._encoder.encode(AbortRequests(ids)), zmq.NOBLOCK)

    def _drop(self, request_id: str) -> None:
        st = self._streams.pop(request_id, None)
        if st is not None:
            self._leaders.forget(request_id, st.group_id)

    def _waiting(self, request_id: str) -> bool:
        st = self._streams.get(request_id)
        return st is not None and not st.started

    def shutdown(self) -> None:
        """Stop the core and remove its IPC files; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self._unlisten()
        if self._watch_task is not None:
            self._watch_task.cancel()
        if self.proc.is_alive():  # SIGKILL: the core ignores SIGTERM (core_proc.ignore_stop_signals)
            self.proc.kill()
            self.proc.join(5)
        self._close_sockets()
        self._ctx.term()
