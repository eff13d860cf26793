"""Data parallelism: N engine-core replicas behind one API server (`--data-parallel-size N`).

Each replica is a full AsyncLLM (its own core process, KV pool, supervisor and share of the
CPU threads); this class looks like one AsyncLLM to the server. A request goes to the
replica the routing policy picks among the live ones (kvserve/routing); its stream belongs to
that replica, so aborts and disconnects free blocks there; the n samples of one prompt stay
together (they share its blocks). A replica that dies fails only its own requests and leaves
the routing set until its supervisor has restarted it. Under `cache-aware` every core
publishes its prefix-cache changes with its step outputs and the router keeps an exact copy.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

from kvserve.config import EngineConfig
from kvserve.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream
from kvserve.engine.core_prespawn import PrespawnedCore, replica_options
from kvserve.engine.messages import EngineCoreOutputs
from kvserve.outputs import RequestOutput
from kvserve.routing import BlockHashIndex, RequestInfo, make_strategy
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_MAX_GROUPS = 4096  # n-sample groups remembered (they are queued together, so few are live)


class Replica:
    """One engine replica as the routing policy sees it: its load is exact (API-side streams)."""

    __slots__ = ("engine", "id", "index", "weight")

    def __init__(self, index: int, engine: AsyncLLM) -> None:
        self.index, self.id, self.engine, self.weight = index, str(index), engine, 1.0

    @property
    def load(self) -> int:
        return self.engine.load_tokens


class DPClient:
    def __init__(
        self,
        config: EngineConfig,
        size: int,
        policy: str = "cache-aware",
        startup_timeout: float = 300.0,
        restart_limit: int = 3,
        prespawned: Sequence[PrespawnedCore] = (),
    ) -> None:
        """`prespawned`: core processes already started for this config (engine/core_prespawn.py
        `start_cores`), one per replica; replicas without one spawn their own."""
        threads, publish = replica_options(config, size, policy)
        ready_cores = list(prespawned)
        make_strategy(policy)  # a bad name fails before any process starts

        engines: list[AsyncLLM] = []
        try:
            for i in range(size):  # spawned here, in the main thread; they load at the same time
                engines.append(
                    AsyncLLM(
                        config,
                        startup_timeout,
                        restart_limit,
                        num_threads=threads,
                        publish_kv_events=publish,
                        wait=False,
                        prespawned=ready_cores[i] if i < len(ready_cores) else None,
                    )  # fmt: skip
                )
            for e in engines:
                e.wait_started()
        except BaseException:
            for e in engines:
                e.shutdown()
            raise
        self.size, self.policy, self.threads_per_replica = size, policy, threads
        self.replicas = [Replica(i, e) for i, e in enumerate(engines)]
        first = engines[0]
        self.config, self.source, self.tokenizer = first.config, first.source, first.tokenizer
        self.ready, self.limits, self.processor = first.ready, first.limits, first.processor
        self.strategy = make_strategy(policy, block_size=self.ready.block_size)
        index = getattr(self.strategy, "index", None)
        self.index = index if isinstance(index, BlockHashIndex) else None
        self._groups: OrderedDict[str, Replica] = OrderedDict()
        self.on_step = None  # callback(EngineCoreOutputs, list[RequestOutput], engine index)
        self.on_core_lost = None  # callback(engine index)
        self.on_abort = None  # callback(RequestOutput, engine index)
        for r in self.replicas:
            r.engine.on_step = lambda core, outs, i=r.index: self._on_step(i, core, outs)
            r.engine.on_core_lost = lambda i=r.index: self._on_core_lost(i)
            r.engine.on_abort = lambda out, i=r.index: self.on_abort and self.on_abort(out, i)

    # ---- per-replica callbacks -------------------------------------------------------------
    def _on_step(self, i: int, core: EngineCoreOutputs, outs: list[RequestOutput]) -> None:
        if self.index is not None and (core.kv_stored or core.kv_removed or core.kv_cleared):
            self.index.apply(str(i), core.kv_stored, core.kv_removed, core.kv_cleared)
        if self.on_step is not None:
            self.on_step(core, outs, i)

    def _on_core_lost(self, i: int) -> None:
        if self.index is not None:
            self.index.forget(str(i))
        if self.on_core_lost is not None:
            self.on_core_lost(i)

    # ---- what the server asks of an engine -------------------------------------------------
    @property
    def engines(self) -> list[AsyncLLM]:
        return [r.engine for r in self.replicas]

    @property
    def is_alive(self) -> bool:
        """Serving as long as one replica is."""
        return any(e.is_alive for e in self.engines)

    def dead_error(self) -> EngineDeadError:
        restarting = [e for e in self.engines if e.restarting]
        return (restarting[0] if restarting else self.engines[0]).dead_error()

    @property
    def num_waiting(self) -> int:
        return sum(e.num_waiting for e in self.engines)

    @property
    def num_in_flight(self) -> int:
        return sum(e.num_in_flight for e in self.engines)

    def start(self) -> None:
        for e in self.engines:
            e.start()

    async def reset_prefix_cache(self) -> None:
        live = [e for e in self.engines if e.is_alive]
        if not live:
            raise self.dead_error()
        for e in live:
            await e.reset_prefix_cache()

    def health(self) -> list[dict]:
        """Per replica: alive, restarting, core pid, requests in flight, load in tokens."""
        return [
            {
                "engine": r.index,
                "alive": r.engine.is_alive,
                "restarting": r.engine.restarting,
                "pid": r.engine.proc.pid,
                "in_flight": r.engine.num_in_flight,
                "load_tokens": r.load,
            }  # fmt: skip
            for r in self.replicas
        ]

    def _route(self, request: RequestInfo, group_id: str | None) -> Replica:
        live = [r for r in self.replicas if r.engine.is_alive]
        if not live:
            raise self.dead_error()
        if group_id is not None:
            owner = self._groups.get(group_id)
            if owner is not None and owner.engine.is_alive:
                return owner
        choice = self.strategy.choose(live, request)
        if group_id is not None:
            self._groups[group_id] = choice
            while len(self._groups) > _MAX_GROUPS:
                self._groups.popitem(last=False)
        return choice

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
        """AsyncLLM.add_request on the replica the policy picks (same errors, same stream)."""
        owner = next((e for e in self.engines if request_id is not None and request_id in e._streams), None)
        if owner is not None:
            held = owner.output_processor.states.get(request_id)
            self.processor.release_lease(params, held.params if held is not None else None)
            raise ValueError(f"request_id: {request_id!r} is already in use")
        ids = prompt_token_ids
        if ids is None and not isinstance(prompt, str):
            ids = list(prompt)
        info = RequestInfo(token_ids=ids, session=session, cache_salt=cache_salt)
        replica = self._route(info, group_id)
        stream = replica.engine.add_request(
            prompt, params, request_id, priority, cache_salt, group_id, prompt_token_ids
        )
        # (a sibling forked from its leader there counts 0 already: engine/group_load.py)
        stream.prefill_tokens = max(0, stream.prefill_tokens - info.cached_tokens)
        return stream

    def fail_all(self, error: Exception) -> None:
        for e in self.engines:
            e.fail_all(error)

    def shutdown(self) -> None:
        for e in self.engines:
            e.shutdown()
