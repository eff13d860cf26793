"""Sizing arithmetic for `kvserve plan`: memory, parallel layout, roofline, cost.

Pure functions returning dataclasses, so the CLI, the JSON output and the tests
all read the same numbers. KV sizing goes through `kvserve.core.kv_sizing`, the
code the engine uses to allocate its pool, so a plan and a running server agree.

Memory model, per GPU (per worker):
    usable   = GPU memory * gpu_memory_utilization
    free     = usable - weights / (tp * pp)
    overhead = overhead_fraction * free      (activations, CUDA graphs, NCCL
                                              buffers, allocator fragmentation)
    kv       = free - overhead               (or --kv-cache-memory when given)
The reserve is a share of what is left after the weights, not of the weights:
30% of the weights would be 21 GB for a 70B fp8 model, far above what its
activations take, and would wrongly rule out the one-H100 deployment the field
runs. A model "fits" a layout when its KV pool holds at least one sequence of
max_model_len tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvserve.core.kv_sizing import (
    DTYPE_BYTES,
    KV_SCALE_BYTES,
    KVPoolSize,
    gpu_kv_budget,
    kv_bytes_per_token,
    kv_pool_size,
    parse_memory_size,
)
from kvserve.planner.gpus import DEFAULT_GPU, GPUSpec, get_gpu
from kvserve.planner.presets import ModelSpec, load_model_spec

GPUS_PER_NODE = 8
HOURS_PER_MONTH = 730  # 365 * 24 / 12
WEIGHT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}
QUANTIZED = ("fp8", "int8", "int4")
_ALIASES = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}
_ALIASES |= {"fp8_e4m3": "fp8", "float8": "fp8", "auto": "auto", "none": "none"}
# vLLM's other fp8 KV cache: 1 byte an element with no per-token scale (e4m3's "fp8" here is
# kvserve's cache, which keeps one); kvserve's engine does not run it, vLLM's does
KV_ONLY_BYTES = {"fp8_e5m2": 1}


def canonical_dtype(name: str) -> str:
    """ "bfloat16" -> "bf16", "float32" -> "fp32"; rejects unknown names."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in WEIGHT_BYTES and key not in ("auto", "none"):
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(WEIGHT_BYTES)}")
    return key


@dataclass(frozen=True)
class Precision:
    """compute: activations and unquantised weights; weights: storage format;
    kv_cache: KV-cache element type."""

    compute: str = "bf16"
    weights: str = "bf16"
    kv_cache: str = "bf16"

    @property
    def kv_bytes(self) -> int:
        return KV_ONLY_BYTES.get(self.kv_cache) or DTYPE_BYTES[self.kv_cache]

    @property
    def kv_scale_bytes(self) -> int:
        """Per token and kv head: kvserve's 1-byte caches keep a bfloat16 scale there."""
        return KV_SCALE_BYTES.get(self.kv_cache, 0)


def resolve_precision(
    dtype: str = "bf16", quantization: str | None = None, kv_cache_dtype: str = "auto"
) -> Precision:
    """`--dtype fp8` is shorthand for bf16 compute with fp8 weights; the KV cache
    follows the compute dtype unless `--kv-cache-dtype` says otherwise (as vLLM)."""
    compute = canonical_dtype(dtype)
    if compute in QUANTIZED:
        if quantization and canonical_dtype(quantization) != compute:  # one would be ignored
            raise ValueError(
                f"dtype {dtype} means {compute} weights, but quantization is {quantization}: give one of them"
            )
        quantization, compute = quantization or compute, "bf16"
    quant = canonical_dtype(quantization) if quantization else "none"
    if quant not in QUANTIZED + ("none",):
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZED)} or none")
    if kv_cache_dtype in (None, "auto"):
        kv = compute
    elif kv_cache_dtype.lower() in KV_ONLY_BYTES:
        kv = kv_cache_dtype.lower()
    else:
        kv = canonical_dtype(kv_cache_dtype)
    if kv not in DTYPE_BYTES and kv not in KV_ONLY_BYTES:
        raise ValueError(f"kv-cache dtype {kv_cache_dtype!r} is not supported")
    return Precision(compute, compute if quant == "none" else quant, kv)


def weight_bytes(spec: ModelSpec, prec: Precision) -> int:
    """All weights. Quantised checkpoints (fp8/int8/int4) keep the embedding and
    lm_head in the compute dtype, as AWQ/GPTQ/fp8 checkpoints do; int4 group
    scales (~3%) are ignored."""
    if prec.weights == prec.compute:
        return int(spec.total_params * WEIGHT_BYTES[prec.compute])
    emb = spec.embedding_params
    rest = spec.total_params - emb
    return int(emb * WEIGHT_BYTES[prec.compute] + rest * WEIGHT_BYTES[prec.weights])


def model_kv_bytes_per_token(spec: ModelSpec, prec: Precision, tp: int = 1, pp: int = 1) -> int:
    """KV bytes per token on one GPU of a tp x pp layout. KV heads split across
    TP ranks and are replicated once TP exceeds them (MLA's latent always is)."""
    layers = math.ceil(spec.num_layers / pp)
    heads = math.ceil(spec.cache_kv_heads / tp)
    return kv_bytes_per_token(layers, heads, spec.cache_head_dim, prec.kv_bytes, prec.kv_scale_bytes)


def valid_tp_degrees(spec: ModelSpec, limit: int = GPUS_PER_NODE) -> list[int]:
    """TP degrees up to one node that split attention heads evenly."""
    kv = spec.cache_kv_heads
    return [
        t for t in (1, 2, 4, 8) if t <= limit and spec.num_heads % t == 0 and (kv % t == 0 or t % kv == 0)
    ]


@dataclass(frozen=True)
class MemoryBreakdown:
    """Per-GPU memory of one tp x pp layout; byte counts, None without a GPU."""

    tensor_parallel: int
    pipeline_parallel: int
    max_model_len: int
    weight_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_token: int
    pool: KVPoolSize
    gpu_memory_bytes: int | None = None
    usable_bytes: int | None = None
    overhead_bytes: int | None = None

    @property
    def kv_bytes_per_sequence(self) -> int:
        return self.kv_bytes_per_token * self.max_model_len

    @property
    def max_concurrency(self) -> float:
        return self.pool.max_concurrency(self.max_model_len)

    @property
    def fits(self) -> bool:
        if self.usable_bytes is not None:
            reserve = self.overhead_bytes or 0
            if reserve < 0 or self.weight_bytes + self.kv_cache_bytes + reserve > self.usable_bytes:
                return False
        return self.max_concurrency >= 1


def memory_breakdown(
    spec: ModelSpec,
    prec: Precision,
    gpu: GPUSpec | None,
    *,
    tp: int = 1,
    pp: int = 1,
    max_model_len: int,
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    overhead: float = 0.3,
    kv_cache_memory: int | None = None,
) -> MemoryBreakdown:
    """Memory of one GPU. With `kv_cache_memory` (bytes per GPU) the KV budget is
    fixed, as the engine's `kv_cache_memory` setting fixes it, and whatever is
    left of `usable` is the overhead reserve."""
    weights = math.ceil(weight_bytes(spec, prec) / (tp * pp))
    per_token = model_kv_bytes_per_token(spec, prec, tp, pp)
    usable = reserve = memory = None
    if gpu is not None:
        memory = gpu.memory_bytes
        usable = int(memory * gpu_memory_utilization)
        free = usable - weights
        if kv_cache_memory is None:
            reserve = int(overhead * max(free, 0))
            kv_cache_memory = gpu_kv_budget(memory, gpu_memory_utilization, weights, overhead)
        else:
            reserve = free - kv_cache_memory
    if kv_cache_memory is None:
        raise ValueError("without a GPU the KV budget (kv_cache_memory) must be given")
    return MemoryBreakdown(
        tensor_parallel=tp,
        pipeline_parallel=pp,
        max_model_len=max_model_len,
        weight_bytes=weights,
        kv_cache_bytes=kv_cache_memory,
        kv_bytes_per_token=per_token,
        pool=kv_pool_size(kv_cache_memory, block_size, per_token),
        gpu_memory_bytes=memory,
        usable_bytes=usable,
        overhead_bytes=reserve,
    )


@dataclass(frozen=True)
class Layout:
    """How to deploy: the field's order is replicas of one GPU, then tensor
    parallel inside a node, then pipeline parallel across nodes; MoE expert
    layers go expert-parallel over the same GPUs."""

    memory: MemoryBreakdown
    replicas: int
    num_gpus: int
    expert_parallel: int
    decision: str
    fits: bool

    @property
    def gpus_per_replica(self) -> int:
        return self.memory.tensor_parallel * self.memory.pipeline_parallel

    @property
    def nodes(self) -> int:
        return math.ceil(self.num_gpus / GPUS_PER_NODE)


def check_parallel(spec: ModelSpec, tp: int | None, pp: int | None) -> None:
    """vLLM's -tp / -pp as given: a degree the model cannot be split by is refused (vLLM's own
    rule: the attention heads divide by tp; the KV heads divide by it, or it by them)."""
    kv = spec.cache_kv_heads

    def splits(t: int) -> bool:
        return spec.num_heads % t == 0 and (kv % t == 0 or t % kv == 0)

    if tp is not None and not splits(tp):
        valid = ", ".join(str(t) for t in range(1, spec.num_heads + 1) if splits(t))
        raise ValueError(
            f"tensor_parallel_size {tp} does not split the model's {spec.num_heads} attention heads "
            f"({kv} KV heads) evenly; it can be {valid}"
        )
    if pp is not None and pp > spec.num_layers:
        raise ValueError(f"pipeline_parallel_size {pp} is more than the model's {spec.num_layers} layers")


def _fit(spec: ModelSpec, mem_args: dict, tp: int | None, pp: int | None) -> MemoryBreakdown:
    """The layout asked for (either degree given: the other is 1, as vLLM's default), or the
    smallest that fits."""
    if tp is None and pp is None:
        return _smallest_fit(spec, mem_args)
    return memory_breakdown(spec, tp=tp or 1, pp=pp or 1, **mem_args)


def _smallest_fit(spec: ModelSpec, mem_args: dict) -> MemoryBreakdown:
    tps = valid_tp_degrees(spec)
    mem = memory_breakdown(spec, tp=tps[0], **mem_args)
    for tp in tps[1:]:
        if mem.fits:
            return mem
        mem = memory_breakdown(spec, tp=tp, **mem_args)
    for pp in range(2, spec.num_layers + 1):
        if mem.fits:
            break
        mem = memory_breakdown(spec, tp=tps[-1], pp=pp, **mem_args)
    return mem


def _decision(
    spec: ModelSpec, mem: MemoryBreakdown, replicas: int, num_gpus: int | None, fixed: bool = False
) -> str:
    tp, pp = mem.tensor_parallel, mem.pipeline_parallel
    if not mem.fits:
        if fixed:
            return f"does not fit at tensor parallel {tp} x pipeline parallel {pp}, at this max_model_len"
        return "does not fit, even split over tensor x pipeline parallel, at this max_model_len"
    if replicas < 1:
        return f"does not fit on {num_gpus} GPU(s): one replica needs {tp * pp}"
    if tp * pp == 1:
        text = f"fits one GPU: serve {replicas} data-parallel replica(s)"
    elif pp == 1 and tp <= GPUS_PER_NODE:
        text = f"fits one node: tensor parallel {tp}, then {replicas} replica(s)"
    elif fixed:
        text = f"tensor parallel {tp} x pipeline parallel {pp} (as asked), {replicas} replica(s)"
    elif tp * pp > GPUS_PER_NODE:
        text = (
            f"larger than one node: tensor parallel {tp} within a node, "
            f"pipeline parallel {pp} across nodes, {replicas} replica(s)"
        )
    else:
        text = (
            f"fits one node: tensor parallel {tp} (the most the {spec.num_heads} heads allow) "
            f"x pipeline parallel {pp}, then {replicas} replica(s)"
        )
    if spec.is_moe:
        text += (
            f"; MoE: expert parallel {tp * pp} for the expert layers"
            if tp * pp > 1
            else "; MoE fits unsharded, no expert parallel needed"
        )
    return text


def choose_layout(
    spec: ModelSpec,
    mem_args: dict,
    *,
    concurrency: int = 1,
    num_gpus: int | None = None,
    max_num_seqs: int = 256,
    tp: int | None = None,
    pp: int | None = None,
) -> Layout:
    """Smallest tp x pp that holds the model plus one max_model_len sequence (or the `tp` x `pp`
    given), then replicas: enough for `concurrency` sequences, or as many as `num_gpus`
    allows. `mem_args` are memory_breakdown's keyword arguments minus tp/pp."""
    mem = _fit(spec, mem_args, tp, pp)
    group = mem.tensor_parallel * mem.pipeline_parallel
    seqs = min(int(mem.max_concurrency), max_num_seqs)
    if num_gpus is not None:
        replicas = num_gpus // group
    else:
        replicas = max(1, math.ceil(concurrency / seqs)) if seqs else 1
    ep = group if spec.is_moe and group > 1 else 1
    decision = _decision(spec, mem, replicas, num_gpus, fixed=tp is not None or pp is not None)
    total = num_gpus if num_gpus is not None else group * replicas
    return Layout(mem, replicas, total, ep, decision, mem.fits and replicas >= 1)


# --- decode throughput: roofline estimate -------------------------------------


def decode_weight_bytes(spec: ModelSpec, prec: Precision, tokens: float) -> float:
    """Weight bytes one decode step of `tokens` sequences reads. The embedding
    table is only gathered (untied); MoE reads the experts the batch routes to:
    expected share 1 - (1 - k/E)^tokens, i.e. top-k at batch 1, all at large batch."""
    total = weight_bytes(spec, prec)
    if not spec.tie_embeddings:
        total -= spec.vocab_size * spec.hidden_size * WEIGHT_BYTES[prec.compute]
    if spec.is_moe:
        touched = 1 - (1 - spec.experts_per_token / spec.num_experts) ** tokens
        total -= spec.expert_params * WEIGHT_BYTES[prec.weights] * (1 - touched)
    return total


def decode_flops_per_token(spec: ModelSpec, context_len: int) -> float:
    """2 FLOPs per active matmul weight plus attention over `context_len` cached
    tokens (QK^T and PV: 2 * ctx * heads * (qk_dim + v_dim) per layer)."""
    matmul = spec.active_params
    if not spec.tie_embeddings:
        matmul -= spec.vocab_size * spec.hidden_size  # embedding gather, no FLOPs
    qk = spec.head_dim + spec.rope_head_dim
    v = spec.v_head_dim or spec.head_dim
    attn = 2 * context_len * spec.num_heads * (qk + v) * spec.num_layers
    return 2 * matmul + attn


@dataclass(frozen=True)
class ThroughputPoint:
    """Roofline decode estimate at `batch_size` concurrent sequences per replica;
    an upper bound (real engines reach roughly half to two-thirds of it)."""

    batch_size: int
    step_ms: float
    tokens_per_s: float  # output tokens/s over all replicas
    bound: str  # "memory" or "compute"


def decode_point(
    spec: ModelSpec, prec: Precision, gpu: GPUSpec, layout: Layout, batch: int, context_len: int
) -> ThroughputPoint:
    """Per GPU, a step moves its weight shard plus its KV shard over HBM
    bandwidth and runs its share of the FLOPs; the larger time wins. With
    pipeline parallel the batch is split into microbatches, one per stage, and a
    step takes pp stage times."""
    mem = layout.memory
    tp, pp = mem.tensor_parallel, mem.pipeline_parallel
    micro = batch / min(batch, pp)
    weights = decode_weight_bytes(spec, prec, micro) / (tp * pp)
    moved = weights + micro * context_len * mem.kv_bytes_per_token
    flops = micro * decode_flops_per_token(spec, context_len) / (tp * pp)
    t_mem = moved / (gpu.bandwidth_gbps * 1e9)
    t_compute = flops / gpu.peak_flops(prec.weights, prec.compute)
    step = pp * max(t_mem, t_compute)
    bound = "memory" if t_mem >= t_compute else "compute"
    return ThroughputPoint(batch, step * 1e3, layout.replicas * batch / step, bound)


def saturated_batch(mem: MemoryBreakdown, context_len: int, max_num_seqs: int = 256) -> int:
    """Sequences of `context_len` tokens the KV pool holds at once, capped by the
    scheduler limit `max_num_seqs`."""
    blocks_per_seq = -(-context_len // mem.pool.block_size)
    return min(mem.pool.num_blocks // blocks_per_seq, max_num_seqs)


def throughput_curve(
    spec: ModelSpec,
    prec: Precision,
    gpu: GPUSpec,
    layout: Layout,
    context_len: int,
    max_num_seqs: int = 256,
) -> list[ThroughputPoint]:
    """Estimates at batch 1, 8, 32, 128 and the largest batch the KV pool holds."""
    top = saturated_batch(layout.memory, context_len, max_num_seqs)
    sizes = sorted({b for b in (1, 8, 32, 128) if b <= top} | ({top} if top else set()))
    return [decode_point(spec, prec, gpu, layout, b, context_len) for b in sizes]


def prefill_tokens_per_s(spec: ModelSpec, prec: Precision, gpu: GPUSpec, num_gpus: int) -> float:
    """Prompt tokens/s when prefill is compute-bound at peak over `num_gpus`."""
    per_token = decode_flops_per_token(spec, 0)
    return num_gpus * gpu.peak_flops(prec.weights, prec.compute) / per_token


# --- cost and break-even --------------------------------------------------------


@dataclass(frozen=True)
class CostEstimate:
    """Self-host cost against an API. Definitions (also in docs/PLAN.md):

    monthly_cost        = num_gpus * price_per_gpu_hour * 730
    cost_per_m_output   = GPU $/h / (saturated decode tokens/s * 3600) * 1e6
    capacity_per_day    = 86400 * utilization / (input_share / prefill_tok_s
                          + (1 - input_share) / decode_tok_s)   [input+output tokens]
    api_price_per_m     = input_share * api_price_in + (1 - input_share) * api_price_out
    break_even_per_day  = (monthly_cost / 30.42 days) / api_price_per_m * 1e6, the daily
                          volume where the API bill equals the GPU bill; None when it
                          exceeds capacity_per_day (self-hosting never breaks even then).
    """

    num_gpus: int
    price_per_gpu_hour: float
    monthly_cost: float
    saturated_tokens_per_s: float
    cost_per_m_output_tokens: float
    utilization: float
    input_share: float
    capacity_tokens_per_day: float
    self_host_cost_per_m_tokens: float
    api_price_per_m_tokens: float | None = None
    break_even_tokens_per_day: float | None = None
    break_even_utilization: float | None = None
    tokens_per_day: float | None = None
    api_monthly_cost: float | None = None
    deployments_needed: int | None = None
    self_host_monthly_cost: float | None = None


def estimate_cost(
    *,
    num_gpus: int,
    price_per_gpu_hour: float,
    decode_tokens_per_s: float,
    prefill_tokens_per_s: float,
    utilization: float = 0.5,
    input_share: float = 0.75,
    api_price_in: float | None = None,
    api_price_out: float | None = None,
    tokens_per_day: float | None = None,
) -> CostEstimate:
    """Cost of one deployment of `num_gpus` GPUs; throughputs are for the whole
    deployment. Prefill and decode are assumed not to overlap (conservative)."""
    hourly = num_gpus * price_per_gpu_hour
    monthly = hourly * HOURS_PER_MONTH
    daily = monthly / (HOURS_PER_MONTH / 24)
    seconds_per_token = input_share / prefill_tokens_per_s + (1 - input_share) / decode_tokens_per_s
    full_capacity = 86400 / seconds_per_token
    capacity = full_capacity * utilization
    api_price = break_even = be_util = api_monthly = needed = self_monthly = None
    if api_price_in is not None or api_price_out is not None:
        api_price = input_share * (api_price_in or 0) + (1 - input_share) * (api_price_out or 0)
        if api_price > 0:
            volume = daily / api_price * 1e6
            break_even = volume if volume <= capacity else None
            be_util = volume / full_capacity
    if tokens_per_day is not None:
        needed = max(1, math.ceil(tokens_per_day / capacity))
        self_monthly = needed * monthly
        if api_price is not None:
            api_monthly = tokens_per_day * api_price / 1e6 * HOURS_PER_MONTH / 24
    return CostEstimate(
        num_gpus=num_gpus,
        price_per_gpu_hour=price_per_gpu_hour,
        monthly_cost=monthly,
        saturated_tokens_per_s=decode_tokens_per_s,
        cost_per_m_output_tokens=hourly / (decode_tokens_per_s * 3600) * 1e6,
        utilization=utilization,
        input_share=input_share,
        capacity_tokens_per_day=capacity,
        self_host_cost_per_m_tokens=daily / capacity * 1e6,
        api_price_per_m_tokens=api_price,
        break_even_tokens_per_day=break_even,
        break_even_utilization=be_util,
        tokens_per_day=tokens_per_day,
        api_monthly_cost=api_monthly,
        deployments_needed=needed,
        self_host_monthly_cost=self_monthly,
    )


# --- the whole plan ---------------------------------------------------------------


@dataclass(frozen=True)
class PlanRequest:
    """Inputs of `kvserve plan`; None means "derive it" (see the CLI help)."""

    model: str
    gpu: str | None = None
    num_gpus: int | None = None
    tensor_parallel_size: int | None = None  # vLLM's -tp: this degree, not the smallest that fits
    pipeline_parallel_size: int | None = None  # vLLM's -pp
    dtype: str = "bf16"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    concurrency: int = 1
    gpu_memory_utilization: float = 0.9
    overhead: float = 0.3
    kv_cache_memory: str | int | None = None
    block_size: int = 16
    context_len: int | None = None
    max_num_seqs: int = 256
    price_per_hour: float | None = None
    api_price_in: float | None = None
    api_price_out: float | None = None
    tokens_per_day: float | None = None
    input_share: float = 0.75
    utilization: float = 0.5


@dataclass(frozen=True)
class Plan:
    """Everything `kvserve plan` reports. Without a GPU (explicit KV budget on
    CPU) only the model, memory and KV pool are filled in."""

    request: PlanRequest
    model: ModelSpec
    precision: Precision
    gpu: GPUSpec | None
    max_model_len: int
    context_len: int
    weight_bytes: int
    kv_bytes_per_token: int
    memory: MemoryBreakdown
    layout: Layout | None = None
    throughput: list[ThroughputPoint] = field(default_factory=list)
    cost: CostEstimate | None = None

    @property
    def kv_pool(self) -> KVPoolSize:
        return self.memory.pool


def _check(req: PlanRequest) -> None:
    if not 0 < req.gpu_memory_utilization <= 1 or not 0 < req.utilization <= 1:
        raise ValueError("gpu_memory_utilization and utilization must be in (0, 1]")
    if not 0 <= req.overhead < 1 or not 0 <= req.input_share <= 1:
        raise ValueError("overhead must be in [0, 1) and input_share in [0, 1]")
    if req.concurrency < 1 or req.block_size < 1 or (req.num_gpus is not None and req.num_gpus < 1):
        raise ValueError("concurrency, block_size and num_gpus must be >= 1")


def make_plan(req: PlanRequest, spec: ModelSpec | None = None) -> Plan:
    """Size `req.model` (or `spec`): memory, layout, throughput, cost. With
    `kv_cache_memory` and no `gpu` this is the CPU / explicit-budget mode that
    predicts exactly the KV pool the engine allocates."""
    _check(req)
    spec = spec or load_model_spec(req.model)
    tp, pp = req.tensor_parallel_size, req.pipeline_parallel_size
    check_parallel(spec, tp, pp)
    prec = resolve_precision(req.dtype, req.quantization, req.kv_cache_dtype)
    if req.max_model_len is not None and req.max_model_len > spec.max_context:  # the engine refuses it
        raise ValueError(
            f"max_model_len {req.max_model_len} is more than the model's context {spec.max_context} "
            "(max_position_embeddings, or its sliding attention window where it has one)"
        )
    max_len = req.max_model_len or spec.max_context
    if req.context_len is not None and req.context_len > max_len:  # was cut to max_len unsaid
        raise ValueError(
            f"context_len {req.context_len} is more than max_model_len {max_len}: no sequence holds that much"
        )
    ctx = min(req.context_len or 2048, max_len)
    kv_budget = None if req.kv_cache_memory is None else parse_memory_size(req.kv_cache_memory)
    gpu = get_gpu(req.gpu) if req.gpu else (None if kv_budget is not None else get_gpu(DEFAULT_GPU))
    mem_args = {
        "prec": prec,
        "gpu": gpu,
        "max_model_len": max_len,
        "block_size": req.block_size,
        "gpu_memory_utilization": req.gpu_memory_utilization,
        "overhead": req.overhead,
        "kv_cache_memory": kv_budget,
    }
    common = {
        "request": req,
        "model": spec,
        "precision": prec,
        "gpu": gpu,
        "max_model_len": max_len,
        "context_len": ctx,
        "weight_bytes": weight_bytes(spec, prec),
        "kv_bytes_per_token": model_kv_bytes_per_token(spec, prec),
    }
    if gpu is None:
        return Plan(memory=memory_breakdown(spec, tp=tp or 1, pp=pp or 1, **mem_args), **common)
    layout = choose_layout(
        spec, mem_args, concurrency=req.concurrency, num_gpus=req.num_gpus, max_num_seqs=req.max_num_seqs,
        tp=tp, pp=pp,
    )  # fmt: skip
    if not layout.fits:
        return Plan(memory=layout.memory, layout=layout, **common)
    curve = throughput_curve(spec, prec, gpu, layout, ctx, req.max_num_seqs)
    cost = None
    if curve:
        cost = estimate_cost(
            num_gpus=layout.num_gpus,
            price_per_gpu_hour=gpu.price_per_hour if req.price_per_hour is None else req.price_per_hour,
            decode_tokens_per_s=curve[-1].tokens_per_s,
            prefill_tokens_per_s=prefill_tokens_per_s(spec, prec, gpu, layout.num_gpus),
            utilization=req.utilization,
            input_share=req.input_share,
            api_price_in=req.api_price_in,
            api_price_out=req.api_price_out,
            tokens_per_day=req.tokens_per_day,
        )
    return Plan(memory=layout.memory, layout=layout, throughput=curve, cost=cost, **common)
