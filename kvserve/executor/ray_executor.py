"""Ranks as Ray actors (`--distributed-executor-backend ray`), for more than one machine.

The engine connects to an existing Ray cluster (`RAY_ADDRESS`, or the cluster `ray start`
left on this machine) and reserves one CPU (or GPU) bundle per rank in a placement group:
`STRICT_PACK` for tensor parallelism (the ranks' all-reduces stay inside one node),
`SPREAD` for pipeline stages (one stage per node when there are nodes to spread over). The
torch.distributed rendezvous is rank 0's node address and a free port there, asked from
rank 0's actor and handed to every actor before it joins the group.

Per step the same msgpack bytes as the multiprocess executor's go to every actor as a
method call; Ray runs one actor's calls in the order they were sent, so the pipeline keeps
its order and stages overlap as with local processes. An actor that dies fails the step
(`RayActorError` -> `RankFailure`), and so does one that hangs: each actor sends heartbeats
over TCP to the engine (`step_channel.start_heartbeat`, as `mp` ranks do over IPC), and
`HANG_S` (1 s) without one fails the executor. The actors are owned by the engine process,
so Ray ends them when it ends, and `shutdown` kills them and frees the placement group.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections import deque

import msgspec
import zmq

from kvserve.distributed.step_channel import decode_output, encode_output, encode_step
from kvserve.executor.base import Executor
from kvserve.executor.multiproc import HANG_S, POLL_MS, STARTUP_TIMEOUT_S, RankFailure
from kvserve.worker.step_input import RunnerOutput, StepInput
from kvserve.worker.worker import WorkerConfig

logger = logging.getLogger(__name__)

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class RankActor:
    """One rank inside a Ray worker process (made a Ray actor class by `RayExecutor`)."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.worker = None

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port on it, for rank 0's process group."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def start(self, cfg_bytes: bytes, rank: int, heartbeat_addr: str) -> float:
        import zmq

        from kvserve.distributed.step_channel import start_heartbeat
        from kvserve.worker.worker import Worker

        self._beat = start_heartbeat(zmq.Context.instance(), str(rank).encode(), heartbeat_addr)
        self.worker = Worker(msgspec.msgpack.decode(cfg_bytes, type=WorkerConfig), rank)
        return self.worker.load_time

    def execute(self, step_bytes: bytes) -> bytes | None:
        from kvserve.distributed.step_channel import decode_step

        out = self.worker.execute_model(decode_step(step_bytes))
        return None if out is None else encode_output(out)

    def rpc(self, method: str):
        return getattr(self.worker, method)()

    def pid(self) -> int:
        return os.getpid()


class RayExecutor(Executor):
    def __init__(self, config, worker_config: WorkerConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        super().__init__(config.seed)
        tp, pp = worker_config.tensor_parallel_size, worker_config.pipeline_parallel_size
        self.world_size = tp * pp
        self.answer_rank = self.world_size - 1 if pp > 1 else 0  # TP rank 0 / the last stage
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False)
        device = "GPU" if worker_config.device.startswith("cuda") else "CPU"
        self.pg = placement_group(
            [{device: 1}] * self.world_size, strategy="SPREAD" if pp > 1 else "STRICT_PACK"
        )
        try:
            ray.get(self.pg.ready(), timeout=60)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.pg)
            raise RuntimeError(
                f"distributed_executor_backend: the Ray cluster has no room for {self.world_size} "
                f"{device} bundles ({ray.cluster_resources()})"
            ) from None
        actor_cls = ray.remote(num_cpus=1 if device == "CPU" else 0, num_gpus=1 if device == "GPU" else 0)(
            RankActor
        )
        env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": _REPO_ROOT}
        self.actors = [
            actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
                runtime_env={"env_vars": env},
            ).remote()
            for r in range(self.world_size)
        ]
        # Heartbeats from every actor over TCP (its node may be another machine), as with `mp`.
        self.zctx = zmq.Context()
        self.beats = self.zctx.socket(zmq.PULL)
        beat_addr = f"tcp://{ray.util.get_node_ip_address()}:{self.beats.bind_to_random_port('tcp://*')}"
        self._finalizer = weakref.finalize(self, _stop, self.actors, self.pg, self.zctx)
        self.failed: str | None = None
        self.last_seen: list[float] | None = None  # per rank, once all are up
        self._refs: deque[list] = deque()
        ip, port = self._get([self.actors[0].rendezvous.remote()], STARTUP_TIMEOUT_S)[0]
        cfg = msgspec.msgpack.encode(msgspec.structs.replace(worker_config, init_method=f"tcp://{ip}:{port}"))
        t0 = time.perf_counter()
        loads = self._get(
            [a.start.remote(cfg, r, beat_addr) for r, a in enumerate(self.actors)], STARTUP_TIMEOUT_S
        )
        self.load_time = max(loads)
        self.last_seen = [time.monotonic()] * self.world_size
        logger.info("%d Ray actors ready in %.1fs (rendezvous %s:%d)", self.world_size,
                    time.perf_counter() - t0, ip, port)  # fmt: skip

    def _check_heartbeats(self) -> None:
        while self.beats.poll(0):
            _, rank, _ = self.beats.recv_multipart()
            if self.last_seen is not None:
                self.last_seen[int(rank)] = time.monotonic()
        if self.last_seen is None:
            return
        now = time.monotonic()
        for r, seen in enumerate(self.last_seen):
            if now - seen > HANG_S:
                raise _Silent(f"rank {r} sent no heartbeat for {now - seen:.1f}s (hung or stopped)")

    def _get(self, refs: list, timeout_s: float | None = None) -> list:
        """Results of `refs`; a dead, failing or silent actor fails the executor for good."""
        import ray

        if self.failed:
            raise RankFailure(self.failed)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while True:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=POLL_MS / 1000)
                for ref in ready:
                    ray.get(ref)  # raises at once for an actor that died or raised
                if len(ready) == len(refs):
                    return ray.get(refs)
                self._check_heartbeats()
                if deadline is not None and time.monotonic() > deadline:
                    raise ray.exceptions.GetTimeoutError()
        except _Silent as e:
            why = str(e)
        except ray.exceptions.RayActorError as e:
            why = f"a rank's Ray actor died: {str(e).strip().splitlines()[0]}"
        except ray.exceptions.RayTaskError as e:
            why = f"a rank raised: {str(e).strip().splitlines()[-1]}"
        except ray.exceptions.GetTimeoutError:
            why = f"no answer from the Ray actors within {timeout_s:.0f}s"
        self.failed = why
        logger.error("Ray executor failed: %s", why)
        self.shutdown()
        raise RankFailure(why)

    def _send(self, step: StepInput) -> None:
        if self.failed:
            raise RankFailure(self.failed)
        data = encode_step(step)
        self._refs.append([a.execute.remote(data) for a in self.actors])

    def _receive(self) -> RunnerOutput:
        outs = self._get(self._refs.popleft())
        return decode_output(outs[self.answer_rank])

    @property
    def pids(self) -> list[int]:
        """The actors' process ids (meaningful on this machine when the cluster is local)."""
        return self._get([a.pid.remote() for a in self.actors])

    def collective_rpc(self, method: str) -> list:
        return self._get([a.rpc.remote(method) for a in self.actors])

    def shutdown(self) -> None:
        self._finalizer()


class _Silent(Exception):
    pass


def _stop(actors: list, pg, zctx) -> None:
    import ray

    zctx.destroy(linger=0)
    if not ray.is_initialized():
        return
    for a in actors:
        try:
            ray.kill(a)
        except Exception:  # noqa: BLE001 - already gone
            pass
    try:
        ray.util.remove_placement_group(pg)
    except Exception:  # noqa: BLE001
        pass
