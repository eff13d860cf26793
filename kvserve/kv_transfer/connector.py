"""What the scheduler and the engine core ask of a KV connector (vLLM's KVConnectorBase_V1
split, one engine process here).

Scheduler side: `num_remote_tokens` (how much of a waiting request's prompt another engine
holds, beyond the local prefix-cache hits), `start_load` (its blocks are allocated: fetch
them), `cancel` (the request was aborted while waiting), `request_finished` (a producer may
keep the blocks of a finished request under a lease; it then answers with the parameters a
consumer needs). Engine side, called by the core between steps in its own thread:
`take_loads` (finished fetches; `write` puts their bytes into the blocks before the next
forward) and `drain_released` (lease blocks to free now).

Fetches run on a small thread pool and never touch the KV pool: they return bytes, and only
the engine thread writes blocks, so a fetch that hangs costs nothing but its timeout.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvserve.kv_transfer.block_io import KVBlockIO
from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.kv_transfer.leases import LeaseTable
from kvserve.kv_transfer.params import prompt_digest, wants_remote_decode
from kvserve.request import Request

logger = logging.getLogger(__name__)


@dataclass
class LoadResult:
    request: Request
    first_block: int  # where the payload starts in the request's block table
    num_blocks: int
    payload: list | None  # one bytes-like per KV tensor; None: failed
    error: str | None = None
    num_bytes: int = 0
    seconds: float = 0.0


@dataclass
class TransferStats:
    """Running totals (the metrics report them)."""

    loads: int = 0
    load_failures: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    leases_expired: int = 0
    latencies: list[float] = field(default_factory=list)  # seconds per load, the last 1,000


class KVConnector:
    name = ""

    def __init__(self, config: KVTransferConfig, io: KVBlockIO, block_size: int) -> None:
        self.config = config
        self.io = io
        self.block_size = block_size
        self.engine_id = config.engine_id or uuid.uuid4().hex[:12]
        self.leases = LeaseTable(config.lease_s)
        self.stats = TransferStats()
        self._results: queue.Queue[LoadResult] = queue.Queue()
        self._loading = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kv-transfer")

    # ---- scheduler side -------------------------------------------------------------------
    def num_remote_tokens(self, req: Request, num_local_tokens: int) -> int:
        """Prompt tokens after the first `num_local_tokens` (block-aligned) another engine can
        supply for this waiting request; 0: compute them here."""
        raise NotImplementedError

    def start_load(self, req: Request, first_block: int, num_blocks: int) -> None:
        """Fetch `num_blocks` blocks of the request's prompt starting at block `first_block`
        (the scheduler has allocated them); the result arrives through `take_loads`."""
        with self._lock:
            self._loading += 1
        self._pool.submit(self._run_load, req, first_block, num_blocks)

    def cancel(self, req: Request) -> None:
        """The request was aborted while its blocks were on the way (its blocks are freed by
        the scheduler; a result that still arrives is dropped)."""

    def request_finished(self, req: Request, blocks: list[int]) -> tuple[bool, dict | None]:
        """A request ended normally: (whether the connector keeps `blocks`, to free later
        through `drain_released`; the kv_transfer_params for its response)."""
        if not (self.config.is_producer and wants_remote_decode(req.params.kv_transfer_params)):
            return False, None
        num_tokens = req.num_prompt_tokens - 1  # the consumer computes the last prompt token
        if num_tokens < 1:
            return False, None
        handle = uuid.uuid4().hex
        needed = -(-num_tokens // self.block_size)
        digest = prompt_digest(req.prompt_token_ids[:num_tokens])
        self.leases.add(handle, blocks, num_tokens, digest)  # all of them, freed together
        self._on_lease(handle, req, blocks[:needed], num_tokens)
        params = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
            "remote_request_id": handle, "remote_num_tokens": num_tokens, "prompt_digest": digest,
            "kv_connector": self.name,
        }  # fmt: skip
        params.update(self._where())
        return True, params

    def _on_lease(self, handle: str, req: Request, blocks: list[int], num_tokens: int) -> None:
        """A connector that pushes (disk) starts here; pulled ones wait for the consumer."""

    def _where(self) -> dict:
        return {}

    # ---- engine side ----------------------------------------------------------------------
    def take_loads(self) -> list[LoadResult]:
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def wait_for_loads(self, timeout: float) -> None:
        """Block until a fetch finishes or `timeout` passes (an engine with nothing else to run)."""
        try:
            self._results.put(self._results.get(timeout=timeout))
        except queue.Empty:
            pass

    def write(self, result: LoadResult, block_ids: list[int]) -> None:
        self.io.scatter(block_ids, result.payload)

    def drain_released(self) -> list[list[int]]:
        before = self.leases.num_expired
        out = self.leases.drain()
        if self.leases.num_expired > before:
            self.stats.leases_expired = self.leases.num_expired
            logger.warning(
                "kv transfer: %d lease(s) expired unclaimed; blocks freed", self.leases.num_expired - before
            )
        return out

    def has_pending(self) -> bool:
        """Leases held or fetches running: the engine must keep polling."""
        with self._lock:
            loading = self._loading
        return bool(loading or len(self.leases))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- fetches --------------------------------------------------------------------------
    def _fetch(self, req: Request, first_block: int, num_blocks: int) -> list:
        """The payload, or raise (any error: the consumer computes the prompt itself)."""
        raise NotImplementedError

    def _run_load(self, req: Request, first_block: int, num_blocks: int) -> None:
        t0 = time.perf_counter()
        try:
            payload = self._fetch(req, first_block, num_blocks)
            result = LoadResult(req, first_block, num_blocks, payload)
            result.num_bytes = sum(memoryview(p).nbytes for p in payload)
        except Exception as e:  # noqa: BLE001 - every failure means the same: recompute
            result = LoadResult(req, first_block, num_blocks, None, f"{type(e).__name__}: {e}")
        result.seconds = time.perf_counter() - t0
        self._record(result)
        with self._lock:
            self._loading -= 1
        self._results.put(result)

    def _record(self, r: LoadResult) -> None:
        s = self.stats
        if r.payload is None:
            s.load_failures += 1
            logger.warning(
                "kv transfer for %s failed (%s); computing its prompt here", r.request.request_id, r.error
            )
            return
        s.loads += 1
        s.load_bytes += r.num_bytes
        s.load_seconds += r.seconds
        s.latencies = s.latencies[-999:] + [r.seconds]
