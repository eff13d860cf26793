"""The main loop of one rank's process (MultiprocExecutor): receive steps, run them, answer.

Each rank runs one torch thread (the ranks share the machine's cores). A rank never outlives
the engine: the kernel kills it when its parent dies (PR_SET_PDEATHSIG), and it also exits
if it finds its parent gone while waiting for a step.
"""

from __future__ import annotations

import ctypes
import os
import signal
import traceback

import msgspec

from kvserve.distributed.step_channel import (
    ERROR,
    OUTPUT,
    READY,
    RPC,
    RPC_RESULT,
    SHUTDOWN,
    STEP,
    RankChannel,
    decode_step,
    encode_output,
)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the parent check in the loop still applies


def run_rank(cfg_bytes: bytes, rank: int, step_addr: str, result_addr: str, parent_pid: int) -> None:
    _die_with_parent()
    # The engine stops its ranks (SHUTDOWN, then SIGKILL): a signal to the whole group (Ctrl-C,
    # `timeout`, systemd's stop) is the API process's to drain on, not a rank's to die of.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch

    torch.set_num_threads(1)
    from kvserve.worker.worker import Worker, WorkerConfig

    chan = RankChannel(rank, step_addr, result_addr)
    chan.start_heartbeat(result_addr)
    try:
        worker = Worker(msgspec.msgpack.decode(cfg_bytes, type=WorkerConfig), rank)
        chan.send(READY, msgspec.msgpack.encode(worker.load_time))
        while True:
            msg = chan.recv(1000)
            if msg is None:
                if os.getppid() != parent_pid:
                    return
                continue
            kind, payload = msg
            if kind == STEP:
                out = worker.execute_model(decode_step(payload))
                if out is not None:
                    chan.send(OUTPUT, encode_output(out))
            elif kind == RPC:
                chan.send(RPC_RESULT, msgspec.msgpack.encode(getattr(worker, payload.decode())()))
            elif kind == SHUTDOWN:
                return
    except Exception:
        chan.send(ERROR, traceback.format_exc().encode())
        raise SystemExit(1) from None
    finally:
        chan.close()


if __name__ == "__main__":
    import base64
    import sys

    cfg, rank, step_addr, result_addr, parent = sys.argv[1:6]
    run_rank(base64.b64decode(cfg), int(rank), step_addr, result_addr, int(parent))
