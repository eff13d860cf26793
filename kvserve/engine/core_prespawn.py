"""`kvserve serve`'s first engine core (each replica's, with data parallelism), started before
the API process's heavy imports.

Both processes import torch and kvserve's engine before the model loads (~1.7 s of CPU each).
Spawned as the engine is built, the core began its imports only once the API process had
finished its own, so a server took both in turn (a tiny model: ~3 s of imports, then ~3 s of
core start). Started first, the core imports on the other core while the API process does, then
waits for its arguments on a pipe. Only the first: a restarted core is spawned as before.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess


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

    def start(self, *args) -> BaseProcess | None:
        """The process, now running the core with `args`; None if it is gone (spawn anew)."""
        try:
            self._writer.send(args)
        except OSError:  # it died importing: the caller spawns a core the usual way
            self.proc.join(5)
            return None
        finally:
            self._writer.close()
        return self.proc

    def cancel(self) -> None:
        """Not needed after all (a bad flag): it is killed, having only imported modules (it
        ignores SIGTERM, as every engine core does, so multiprocessing's exit would wait for
        its imports). Nothing once `start` has handed it the core."""
        if self._writer.closed:
            return
        self._writer.close()
        self.proc.kill()
        self.proc.join(5)


def _await_arguments(reader: Connection) -> None:
    from kvserve.engine.core_proc import _die_with_parent, ignore_stop_signals, run_engine_core

    _die_with_parent()
    ignore_stop_signals()
    # The heavy imports, beside the API process's: the engine (torch) and transformers, which the
    # core's tokenizer needs (~1 s of a tiny model's ~1.3 s load).
    import transformers  # noqa: F401

    import kvserve.engine.core  # noqa: F401

    try:
        args = reader.recv()
    except EOFError:
        return
    finally:
        reader.close()
    run_engine_core(*args)
