"""The engine core in its own process: a busy loop of `step()`, fed over ZeroMQ.

The API process binds two sockets; this process connects: it PULLs add/abort messages and
PUSHes one EngineCoreOutputs message per step. Between steps it drains every pending
message without blocking; when idle it blocks on the input socket, so it never waits on
HTTP and never spins.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback

import msgspec
import zmq

from kvserve.config import EngineConfig
from kvserve.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from kvserve.platform.memory import trim_heap

IDLE_POLL_MS = 250  # how often an idle core looks at its ranks
TRANSFER_POLL_MS = 10  # how often an idle core with KV leases or fetches looks at them


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class ResetPrefixCache(msgspec.Struct, tag=True, array_like=True):
    pass


class Ready(msgspec.Struct, tag=True, array_like=True):
    """Sent once after loading, with what the API side needs to validate requests."""

    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    kv_cache_bytes: int
    pid: int


class Failed(msgspec.Struct, tag=True, array_like=True):
    error: str


InputMessage = AddRequest | AbortRequests | ResetPrefixCache
OutputMessage = Ready | Failed | EngineCoreOutputs


def _die_with_parent() -> None:
    """Never outlive the API process, however it ends (even SIGKILL): ask the kernel to kill
    us when it dies (Linux), and also exit if we find ourselves re-parented."""
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def ignore_stop_signals() -> None:
    """SIGINT and SIGTERM are the API process's to act on: a terminal's Ctrl-C, `timeout`, or
    systemd's stop reach every process of the group (or cgroup), and a core that died of them
    would be restarted in the middle of the drain they start, failing the requests it was
    finishing. The API process stops the core with SIGKILL (AsyncLLM.shutdown), and the kernel
    does when the API process dies (PR_SET_PDEATHSIG)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def run_engine_core(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    num_threads: int | None = None,
    publish_kv_events: bool = False,
) -> None:
    """Process entry point. A data-parallel replica gets its share of the CPU threads
    (`num_threads`) and, under cache-aware routing, publishes its prefix-cache changes."""
    _die_with_parent()
    if num_threads is not None:
        import torch

        torch.set_num_threads(num_threads)
    ignore_stop_signals()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s [core]: %(message)s")
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    try:
        from kvserve.engine.core import EngineCore

        core = EngineCore(config)
        if publish_kv_events:
            core.enable_kv_events()
    except Exception as e:
        out.send(encoder.encode(Failed(f"{type(e).__name__}: {e}")))
        return
    out.send(
        encoder.encode(
            Ready(
                core.arch.vocab_size, core.max_model_len, core.pool_size.num_blocks,
                core.pool_size.block_size, core.pool_size.total_bytes, os.getpid(),
            )
        )
    )  # fmt: skip
    decoder = msgspec.msgpack.Decoder(InputMessage)
    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    trimmed = True  # whether the heap was trimmed since the last step
    faulting = True  # the KV pool's pages still to fault in, a slice per idle turn (huge_pages.py)
    warmed = False  # whether the grammar compiler was readied (after the faults: both take the mmap lock)
    try:
        while True:
            busy = core.has_unfinished_requests()
            idle_ms = TRANSFER_POLL_MS if core.has_pending_transfers() else IDLE_POLL_MS
            events = dict(poller.poll(0 if busy or faulting else idle_ms))
            if not busy:
                core.executor.check_health()  # a dead or hung rank ends this process when idle too
                if not events and faulting:
                    faulting = any(core.executor.collective_rpc("fault_in_kv"))
                elif not events and not warmed:
                    core.compiling.warm()  # the tokenizer and xgrammar's vocabulary, in a thread
                    warmed = True
                elif not events and not trimmed:
                    # Idle for a poll interval: return what the last burst's steps freed
                    # (platform/memory.py); not between back-to-back requests, which would
                    # fault the same pages in again.
                    trim_heap()
                    trimmed = True
            rejected: list[EngineCoreOutput] = []
            while events.get(inp) == zmq.POLLIN:
                msg = decoder.decode(inp.recv())
                if isinstance(msg, AddRequest):
                    try:
                        core.add_request(msg.request)
                    except ValueError as e:
                        # The request's own parameters (n beams past the seats, its id in use): a 400.
                        rid = msg.request.request_id
                        rejected.append(
                            EngineCoreOutput(rid, [], finish_reason="error", stop_reason=str(e), refused=True)
                        )
                elif isinstance(msg, AbortRequests):
                    core.abort_requests(msg.request_ids)
                else:
                    core.reset_prefix_cache()
                events = dict(poller.poll(0))
            if core.has_unfinished_requests() or rejected:
                trimmed = False
                result = core.step() if core.has_unfinished_requests() else EngineCoreOutputs([])
                result.outputs.extend(rejected)
                out.send(encoder.encode(result))
            elif busy:
                out.send(encoder.encode(core.step()))  # report the now-idle stats once
            elif core.poll_transfers():  # lease blocks freed while idle: report the pool
                out.send(encoder.encode(core.step()))
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        # Exit now: the API side fails the in-flight requests once this process is gone, and
        # an orderly interpreter teardown (torch, sockets) takes seconds on a loaded machine.
        # Ranks were killed by the executor, or die with us (PR_SET_PDEATHSIG).
        os._exit(1)
