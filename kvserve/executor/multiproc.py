"""One process per rank (tensor-parallel rank or pipeline stage) on this machine; gloo (CPU)
or NCCL (CUDA) between them, ZeroMQ IPC for the per-step control plane (distributed/step_channel.py).

A rank that dies is noticed while the engine waits for a step's answer (its process is
polled every 20 ms while waiting) and turns into `RankFailure`; so does a rank that hangs or
is stopped: it stops sending heartbeats, and `HANG_S` without one fails it (a rank that is
merely slow keeps beating from its heartbeat thread). A rank that raises reports its
traceback. Either way the executor is dead from then on and kills every rank. When the
engine is idle, `check_health` does the same checks.
"""

from __future__ import annotations

import base64
import logging
import os
import socket
import subprocess
import sys
import time
import weakref
from collections import deque

import msgspec

from kvserve.distributed.step_channel import (
    ERROR,
    HEARTBEAT,
    OUTPUT,
    READY,
    RPC,
    RPC_RESULT,
    SHUTDOWN,
    STEP,
    EngineChannel,
    decode_output,
    encode_step,
)
from kvserve.executor.base import Executor
from kvserve.worker.step_input import RunnerOutput, StepInput
from kvserve.worker.worker import WorkerConfig

logger = logging.getLogger(__name__)

POLL_MS = 20
HANG_S = float(os.environ.get("KVSERVE_RANK_HANG_S", "1.0"))  # silence that counts as a hang
STARTUP_TIMEOUT_S = 600.0


class RankFailure(RuntimeError):
    """A worker rank died or raised; the engine cannot continue."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    def __init__(self, config, worker_config: WorkerConfig) -> None:
        super().__init__(config.seed)
        self.world_size = worker_config.tensor_parallel_size * worker_config.pipeline_parallel_size
        self.failed: str | None = None
        self.chan = EngineChannel(self.world_size)
        cfg = msgspec.structs.replace(worker_config, init_method=f"tcp://127.0.0.1:{free_port()}")
        cfg_arg = base64.b64encode(msgspec.msgpack.encode(cfg)).decode()
        # Plain subprocesses, not multiprocessing: no re-import of the caller's __main__, and the
        # engine core may itself be a daemonic process (which multiprocessing forbids to fork).
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvserve.executor.worker_proc",
                    cfg_arg,
                    str(r),
                    self.chan.step_addrs[r],
                    self.chan.result_addr,
                    str(os.getpid()),
                ],
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )  # fmt: skip
            for r in range(self.world_size)
        ]
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.chan)
        self._early: deque[bytes] = deque()  # step answers that arrived while an RPC waited
        self.last_seen: list[float] | None = None  # per rank, once all are up (loading may stall)
        t0 = time.perf_counter()
        load_times = [msgspec.msgpack.decode(p) for p in self._collect(READY, STARTUP_TIMEOUT_S)]
        self.last_seen = [time.monotonic()] * self.world_size
        self.load_time = max(load_times)
        logger.info(
            "%d ranks ready in %.1fs (pids %s)",
            self.world_size,
            time.perf_counter() - t0,
            [p.pid for p in self.procs],
        )

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _check(self) -> None:
        if self.failed:
            raise RankFailure(self.failed)
        for r, p in enumerate(self.procs):
            if p.poll() is not None:
                self._fail(f"rank {r} (pid {p.pid}) exited with code {p.returncode}")

    def _fail(self, why: str) -> None:
        """Kill every rank at once (a survivor may be stuck in a collective with the dead one)."""
        self.failed = why
        logger.error("tensor-parallel executor failed: %s", why)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        self.shutdown()
        raise RankFailure(why)

    def _next(self, timeout_ms: int) -> tuple[bytes, int, bytes] | None:
        """The next answer that is not a heartbeat, or None after about timeout_ms. Only when
        nothing is queued is silence judged, so heartbeats that piled up while the engine was
        busy elsewhere count as the signs of life they are."""
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            msg = self.chan.poll(max(0, int((deadline - time.monotonic()) * 1000)))
            now = time.monotonic()
            if msg is None:
                if self.last_seen is not None:
                    for r, seen in enumerate(self.last_seen):
                        if now - seen > HANG_S:
                            self._fail(
                                f"rank {r} (pid {self.procs[r].pid}) sent no heartbeat for "
                                f"{now - seen:.1f}s (hung or stopped)"
                            )
                return None
            kind, rank, payload = msg
            if self.last_seen is not None:
                self.last_seen[rank] = now
            if kind == ERROR:
                self._rank_error(rank, payload)
            if kind != HEARTBEAT:
                return msg

    def _rank_error(self, rank: int, payload: bytes) -> None:
        err = payload.decode(errors="replace").strip().splitlines()[-1]
        time.sleep(0.1)  # a collective error on a survivor often means another rank died
        dead = [f"rank {r} (pid {p.pid}) exited with code {p.returncode}"
                for r, p in enumerate(self.procs) if p.poll() is not None and r != rank]  # fmt: skip
        self._fail("; ".join(dead + [f"rank {rank} raised: {err}"]))

    def _collect(self, kind: bytes, timeout_s: float | None = None, count: int | None = None) -> list[bytes]:
        """Payloads of `count` (default: every rank) answers of `kind`, in rank order."""
        count = self.world_size if count is None else count
        got: dict[int, bytes] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(got) < count:
            self._check()
            msg = self._next(POLL_MS)
            if msg is None:
                if deadline is not None and time.monotonic() > deadline:
                    self._fail(f"no {kind!r} answer from the ranks within {timeout_s:.0f}s")
                continue
            k, rank, payload = msg
            if k == OUTPUT and kind != OUTPUT and self.num_in_flight > len(self._early):
                self._early.append(payload)  # a step in flight answered during an RPC: keep it
                continue
            if k != kind:
                self._fail(f"rank {rank} sent {k!r}, expected {kind!r}")
            got[rank] = payload
        return [got[r] for r in sorted(got)]

    def _send(self, step: StepInput) -> None:
        self._check()
        self.chan.broadcast(STEP, encode_step(step), self._check)

    def _receive(self) -> RunnerOutput:
        if self._early:
            return decode_output(self._early.popleft())
        return decode_output(self._collect(OUTPUT, count=1)[0])

    def collective_rpc(self, method: str) -> list:
        self._check()
        self.chan.broadcast(RPC, method.encode(), self._check)
        return [msgspec.msgpack.decode(p) for p in self._collect(RPC_RESULT)]

    def check_health(self) -> None:
        """Between steps: a rank that exited, raised or went silent fails the executor."""
        self._check()
        msg = self._next(0)
        if msg is not None:
            self._fail(f"rank {msg[1]} sent {msg[0]!r} between steps")

    def shutdown(self) -> None:
        self._finalizer()


def _stop(procs: list, chan: EngineChannel) -> None:
    """Ask every rank to exit, then make sure: terminate, kill. Runs once (weakref.finalize)."""
    try:
        chan.broadcast(SHUTDOWN)
    except Exception:  # noqa: BLE001 - the sockets may already be gone
        pass
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    chan.close()
