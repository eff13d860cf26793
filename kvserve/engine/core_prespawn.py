"""`kvserve serve`'s engine cores (one per data-parallel replica), spawned before the API
process's heavy imports and handed their arguments as soon as the configuration is parsed.

Both processes import torch and kvserve's engine before the model loads (~1.7 s of CPU each).
Spawned as the engine was built, the core began its imports only once the API process had
finished its own, so a server took both in turn. Spawned first, the core imports on the other
core while the API process does; given its arguments as soon as the command line is read, it
loads the model (~3-5 s for the default model) while the API process is still importing the
server, and queues its Ready message until the API process binds the sockets it connected to
(ZeroMQ keeps a connecting peer's messages). A restarted core is spawned as before.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import uuid
from multiprocessing.connection import Connection
from typing import Any


def core_addresses() -> tuple[str, str]:
    """Fresh IPC addresses (requests in, outputs out) for one core process: nothing queued for a
    dead core reaches its successor."""
    base = os.path.join(tempfile.gettempdir(), f"kvserve-{uuid.uuid4().hex[:12]}")
    return f"ipc://{base}-in", f"ipc://{base}-out"


def replica_options(config: Any, size: int, policy: str) -> tuple[int | None, bool]:
    """(threads, publishes prefix-cache events) for each of `size` data-parallel replicas'
    cores: the CPU's threads split between them; events where cache-aware routing reads them."""
    threads = max(1, (os.cpu_count() or 1) // size)
    return threads, policy == "cache-aware" and config.enable_prefix_caching


class PrespawnedCore:
    """A spawned process importing the engine; `start` hands it run_engine_core's arguments."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        reader, self._writer = ctx.Pipe(duplex=False)
        # daemon: multiprocessing also ends it when this process exits without using it
        self.proc = ctx.Process(
            target=_await_arguments, args=(reader,), name="kvserve-engine-core", daemon=True
        )
        self.proc.start()
        reader.close()
        self.args: tuple | None = None  # what it was started with
        self.taken = False

    def start(self, config: Any, num_threads: int | None = None, publish_kv_events: bool = False) -> bool:
        """Start the core on its own fresh addresses (`args[1:3]`, for the engine client to
        bind); False if the process is gone (the client spawns one the usual way)."""
        args = (config, *core_addresses(), num_threads, publish_kv_events)
        try:
            self._writer.send(args)
        except OSError:  # it died importing
            self.proc.join(5)
            return False
        finally:
            self._writer.close()
        self.args = args
        return True

    def take(self, config: Any, num_threads: int | None, publish_kv_events: bool) -> tuple[str, str] | None:
        """The started core's addresses, if it runs `config` with these options; the engine
        client owns the process from here. Otherwise None, and the process is killed."""
        options = (num_threads, publish_kv_events)
        if self.args is None or self.args[0] is not config or self.args[3:] != options:
            self.cancel()
            return None
        self.taken = True
        return self.args[1], self.args[2]

    def cancel(self) -> None:
        """Not needed after all (a bad flag, a failed start): it is killed, whether it is still
        importing or already loading (it ignores SIGTERM, as every engine core does). Nothing once
        an engine client has taken it."""
        if self.taken:
            return
        self._writer.close()
        self.proc.kill()
        self.proc.join(5)


def start_cores(cores: list[PrespawnedCore], config: Any, policy: str) -> None:
    """Hand each prespawned core its arguments: one engine's (`AsyncLLM`), or each
    data-parallel replica's (`DPClient`, routing by `policy`)."""
    dp = config.data_parallel_size > 1
    threads, publish = replica_options(config, len(cores), policy) if dp else (None, False)
    for core in cores:
        core.start(config, threads, publish)


def _await_arguments(reader: Connection) -> None:
    from kvserve.engine.core_proc import _die_with_parent, ignore_stop_signals, run_engine_core

    _die_with_parent()
    ignore_stop_signals()
    # The heavy import, beside the API process's: the engine (torch). Not transformers: a GGUF
    # core builds its tokenizer only for a grammar (EngineCore.tokenizer).
    import kvserve.engine.core  # noqa: F401

    try:
        args = reader.recv()
    except EOFError:
        return
    finally:
        reader.close()
    run_engine_core(*args)
