"""One rank: joins the tensor-parallel group (or the pipeline), loads its shard (or stage) of
the model (and the draft model, single-rank only), allocates its KV pool, and runs steps. The
same class runs inside the engine process (UniProcExecutor), in a child process
(MultiprocExecutor) or in a Ray actor; everything it is given is plain data (`WorkerConfig`)."""

from __future__ import annotations

import time

import msgspec
import torch

from kvserve.distributed.parallel_state import get_pp_group, get_tp_group, init_tensor_parallel
from kvserve.model.loader import load_weights_only, resolve_model
from kvserve.platform.onednn_cache import cap_onednn_caches
from kvserve.worker.model_runner import ModelRunner
from kvserve.worker.step_input import RunnerOutput, StepInput

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class WorkerConfig(msgspec.Struct, omit_defaults=True):
    model: str
    dtype: str  # float32 | bfloat16
    device: str
    num_blocks: int
    block_size: int
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    draft_model: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    init_method: str = ""  # torch.distributed rendezvous, e.g. tcp://127.0.0.1:29500
    collective_timeout_s: float = 30.0
    enforce_eager: bool = False  # CUDA only: no decode CUDA graphs
    max_num_seqs: int = 128  # the largest decode graph captured
    max_model_len: int = 0  # the graphs' block-table width (0: no graphs)
    seed: int = 0  # rows sampled on the device without a seed of their own draw from this


class Worker:
    def __init__(self, cfg: WorkerConfig, rank: int = 0) -> None:
        t0 = time.perf_counter()
        self.rank = rank
        device = torch.device(cfg.device)
        if device.type == "cpu":
            cap_onednn_caches()  # before the first kernel is built: loading packs the weights
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda" and cfg.tensor_parallel_size * cfg.pipeline_parallel_size > 1:
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        init_tensor_parallel(
            rank, cfg.tensor_parallel_size, cfg.init_method, backend, cfg.collective_timeout_s,
            cfg.pipeline_parallel_size,
        )  # fmt: skip
        dtype = _DTYPES[cfg.dtype]
        self.model = load_weights_only(resolve_model(cfg.model), dtype, device, cfg.quantization)
        draft = None
        if cfg.draft_model is not None:
            draft = load_weights_only(resolve_model(cfg.draft_model), dtype, device)
        self.load_time = time.perf_counter() - t0
        self.steps, self.execute_s = 0, 0.0
        self.model_runner = ModelRunner(
            self.model, cfg.num_blocks, cfg.block_size, device, kv_cache_dtype=cfg.kv_cache_dtype,
            draft_model=draft, seed=cfg.seed,
        )  # fmt: skip
        single_rank = cfg.tensor_parallel_size * cfg.pipeline_parallel_size == 1
        if device.type == "cuda" and not cfg.enforce_eager and single_rank and cfg.max_model_len:
            self.model_runner.capture_decode_graphs(cfg.max_num_seqs, cfg.max_model_len)

    def execute_model(self, step: StepInput) -> RunnerOutput | None:
        t0 = time.perf_counter()
        out = self.model_runner.execute(step)
        self.execute_s += time.perf_counter() - t0
        self.steps += 1
        return out

    def stats(self) -> dict[str, float]:
        """Totals since the last reset: steps, seconds in execute_model, seconds in collectives."""
        tp = get_tp_group()
        return {
            "steps": self.steps, "execute_s": self.execute_s, "collective_s": tp.collective_s,
            "pipeline_comm_s": get_pp_group().comm_s,
        }  # fmt: skip

    def reset_stats(self) -> None:
        self.steps, self.execute_s = 0, 0.0
        get_tp_group().collective_s = 0.0
        get_pp_group().comm_s = 0.0

    def weight_bytes(self) -> int:
        return self.model.weight_bytes()

    def kv_cache_bytes(self) -> int:
        kv, scales = self.model_runner.kv_cache, self.model_runner.kv_scales
        return sum(t.numel() * t.element_size() for t in (kv, scales) if t is not None)

    def fault_in_kv(self) -> bool:
        """Fault in a slice of the KV pool's pages (the core calls this while idle); True while
        more remain."""
        return self.model_runner.kv_pending_faults.step()

    def ping(self) -> int:
        return self.rank

    def probe_pipeline_send(self) -> float:
        """Mean seconds to hand a [16, hidden] float32 activation (a micro-batch at batch 32,
        PP=2) from stage 0 to stage 1, after a barrier (0.0 without pipeline parallelism)."""
        import torch.distributed as dist

        pp = get_pp_group()
        if pp.size == 1:
            return 0.0
        x = torch.zeros(16, self.model.arch.hidden_size)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(200):
            if pp.stage == 0:
                dist.send(x, 1)
            elif pp.stage == 1:
                dist.recv(x, 0)
        dist.barrier()
        return (time.perf_counter() - t0) / 200

    def probe_all_reduce(self) -> float:
        """Mean seconds of one all-reduce of a [32, hidden] float32 tensor (a decode step at
        batch 32 does two per layer plus one for the embedding), after a barrier: transport
        cost without the wait for a slower rank that step timings include."""
        import torch.distributed as dist

        tp = get_tp_group()
        if tp.size == 1:
            return 0.0
        x = torch.zeros(32, self.model.arch.hidden_size)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(200):
            dist.all_reduce(x)
        return (time.perf_counter() - t0) / 200
