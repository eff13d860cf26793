"""The per-step control plane between the engine and its worker processes, over ZeroMQ IPC.

The engine has one PUSH socket per rank (every rank gets the same bytes: the step is encoded
once; PUSH queues until the peer connects, so there is no subscription race as with PUB/SUB)
and one PULL socket all ranks push to. Messages are two frames: a one-byte kind and a
msgpack payload. Only rank 0 answers a step (its logits); every rank answers an RPC, and
any rank may report an error at any time. Every rank also sends a heartbeat every
`HEARTBEAT_S` from a thread of its own (its own socket: ZeroMQ sockets are not thread-safe),
so the engine can tell a rank that is stopped or hung (no heartbeat) from one that is busy.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time

import msgspec
import numpy as np
import torch
import zmq

from kvserve.worker.step_input import RunnerOutput, StepInput

STEP, RPC, SHUTDOWN = b"S", b"R", b"Q"  # engine -> ranks
READY, OUTPUT, RPC_RESULT, ERROR, HEARTBEAT = b"r", b"o", b"p", b"e", b"h"  # ranks -> engine


HEARTBEAT_S = 0.1


class WireOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """RunnerOutput with the logits as raw float32 bytes."""

    sample_req_ids: list[str] = []
    verify: list[tuple[str, int]] = []
    logits: bytes | None = None
    num_rows: int = 0
    prompt_logprobs: dict[str, list[dict[int, float] | None]] = {}
    pooled: dict[str, list[float]] = {}
    sampled: dict[str, int] = {}
    prompt_logprob_ranks: dict[str, list[int]] = {}


_step_encoder = msgspec.msgpack.Encoder()
_step_decoder = msgspec.msgpack.Decoder(StepInput)
_out_decoder = msgspec.msgpack.Decoder(WireOutput)


def encode_step(step: StepInput) -> bytes:
    return _step_encoder.encode(step)


def decode_step(data: bytes) -> StepInput:
    return _step_decoder.decode(data)


def encode_output(out: RunnerOutput) -> bytes:
    logits = None if out.logits is None else out.logits.contiguous().numpy().tobytes()
    rows = 0 if out.logits is None else out.logits.shape[0]
    pooled = {rid: v.tolist() for rid, v in out.pooled.items()}
    return _step_encoder.encode(
        WireOutput(
            out.sample_req_ids, out.verify, logits, rows, out.prompt_logprobs, pooled, out.sampled,
            out.prompt_logprob_ranks,
        )
    )  # fmt: skip


def decode_output(data: bytes) -> RunnerOutput:
    w = _out_decoder.decode(data)
    logits = None
    if w.logits is not None:  # writable: the sampler masks and biases rows in place
        logits = torch.from_numpy(
            np.frombuffer(bytearray(w.logits), dtype=np.float32).reshape(w.num_rows, -1)
        )
    pooled = {rid: torch.tensor(v) for rid, v in w.pooled.items()}
    verify = [tuple(v) for v in w.verify]
    return RunnerOutput(
        w.sample_req_ids, verify, logits, w.prompt_logprobs, pooled, w.sampled, w.prompt_logprob_ranks
    )


def ipc_dir() -> str:
    return tempfile.mkdtemp(prefix="kvserve-ipc-")


class EngineChannel:
    """The engine's end: one PUSH per rank, one PULL for all answers."""

    def __init__(self, world_size: int) -> None:
        self.dir = ipc_dir()
        self.ctx = zmq.Context()
        self.result_addr = f"ipc://{os.path.join(self.dir, 'results')}"
        self.results = self.ctx.socket(zmq.PULL)
        self.results.bind(self.result_addr)
        self.step_addrs, self.to_ranks = [], []
        for r in range(world_size):
            addr = f"ipc://{os.path.join(self.dir, f'rank{r}')}"
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(addr)
            self.step_addrs.append(addr)
            self.to_ranks.append(sock)

    def broadcast(self, kind: bytes, payload: bytes = b"", alive=None) -> None:
        """Send to every rank. A PUSH to a peer that is gone would block forever, so sends do
        not block: while one cannot go out, `alive()` (raises for a dead rank) is consulted;
        without `alive` a send that cannot go out at once is dropped (shutdown)."""
        for sock in self.to_ranks:
            while True:
                try:
                    sock.send_multipart([kind, payload], flags=zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    if alive is None:
                        break
                    alive()
                    time.sleep(0.005)

    def poll(self, timeout_ms: int) -> tuple[bytes, int, bytes] | None:
        """(kind, rank, payload) of the next answer, or None after timeout_ms."""
        if not self.results.poll(timeout_ms):
            return None
        kind, rank, payload = self.results.recv_multipart()
        return kind, int(rank), payload

    def close(self) -> None:
        self.ctx.destroy(linger=0)
        for name in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, name))
        os.rmdir(self.dir)


def start_heartbeat(ctx: zmq.Context, rank: bytes, addr: str) -> tuple[threading.Event, threading.Thread]:
    """Send HEARTBEAT (tagged `rank`) to `addr` every HEARTBEAT_S until the event is set, from a
    thread with its own socket. It keeps beating while the main thread computes (torch ops
    and collectives release the GIL) and stops when the whole process is stopped (SIGSTOP)
    or dies. The Ray executor's actors beat over TCP to the engine the same way."""
    stop = threading.Event()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            try:
                sock.send_multipart([HEARTBEAT, rank, b""], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # engine busy or gone: the next beat tries again
        sock.close()

    thread = threading.Thread(target=beat, daemon=True, name="heartbeat")
    thread.start()
    return stop, thread


class RankChannel:
    """A rank's end: PULL its steps, PUSH answers (tagged with its rank)."""

    def __init__(self, rank: int, step_addr: str, result_addr: str) -> None:
        self.rank = str(rank).encode()
        self.ctx = zmq.Context()
        self.steps = self.ctx.socket(zmq.PULL)
        self.steps.connect(step_addr)
        self.answers = self.ctx.socket(zmq.PUSH)
        self.answers.setsockopt(zmq.LINGER, 1000)
        self.answers.connect(result_addr)

    def start_heartbeat(self, result_addr: str) -> threading.Event:
        self._stop_beat, self._beat = start_heartbeat(self.ctx, self.rank, result_addr)
        return self._stop_beat

    def recv(self, timeout_ms: int) -> tuple[bytes, bytes] | None:
        if not self.steps.poll(timeout_ms):
            return None
        kind, payload = self.steps.recv_multipart()
        return kind, payload

    def send(self, kind: bytes, payload: bytes = b"") -> None:
        self.answers.send_multipart([kind, self.rank, payload], copy=False)

    def close(self) -> None:
        if getattr(self, "_beat", None) is not None:
            self._stop_beat.set()
            self._beat.join()
        self.ctx.destroy(linger=1000)
