"""Every engine knob in one place, with defaults that work on a laptop CPU."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.core.kv_sizing import parse_memory_size
from kvserve.kv_transfer.config import KVTransferConfig, parse_kv_transfer_config

if TYPE_CHECKING:
    import torch

# torch's names for the accepted spellings. No torch import here: `kvserve serve` starts its
# engine process before its own heavy imports (engine/core_prespawn.py), and the command line
# reads this module first.
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
_DTYPES_SAID = "float32 (fp32; vLLM's float) or bfloat16 (bf16); auto: float32"


def vllm_dtype(text: str) -> str | None:
    """vLLM's --dtype / LLM(dtype=...) spellings: auto (None: kvserve's default), float (float32),
    and kvserve's own. float16 / half, which kvserve has no kernels for, were refused only once
    serve's engine processes had started; this refuses them (and any other) where it is called."""
    value = text.strip().lower()
    if value == "auto":
        return None
    if value == "float":
        return "float32"
    if value in _DTYPES:
        return value
    why = "float16 (half) is not supported here" if value in ("float16", "half", "fp16") else "unknown"
    raise ValueError(f"dtype: {text!r}: {why}; use {_DTYPES_SAID}")


EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over ranks (vLLM's flags and meanings)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str = "mp"

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend: {self.distributed_executor_backend!r} is not one of mp, ray"
            )
        if self.pipeline_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise ValueError(
                "pipeline_parallel_size: tensor and pipeline parallelism together are not supported yet; "
                "use one of them"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class EngineConfig:
    model: str = field(
        default="smollm2-135m",
        metadata={"help": "Alias 'smollm2-135m', a .gguf file, or a Hugging Face model directory."},
    )
    tokenizer: str | None = field(
        default=None,
        metadata={
            "help": "As vLLM's: a Hugging Face tokenizer directory (or .gguf) used instead of the "
            "model's own, its chat template included; its vocabulary must fit the model's."
        },
    )
    dtype: str = field(
        default="float32",
        metadata={
            "help": "Weights and activations: float32 or bfloat16 (on a CPU without avx512_bf16 / "
            "amx_bf16, bfloat16 runs as float32: it would be several times slower); auto (vLLM's "
            "default): float32."
        },
    )
    device: str = field(default="auto", metadata={"help": "'cpu', 'cuda' or 'auto' (CUDA when available)."})
    kv_cache_memory: str | int | None = field(
        default=None,
        metadata={
            "help": (
                'KV pool budget, e.g. "2GiB". Default: 1GiB on CPU; on CUDA derived from '
                "gpu_memory_utilization."
            )
        },
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata={"help": "On CUDA, the fraction of device memory kvserve may use (weights + KV pool)."},
    )
    enforce_eager: bool = field(
        default=False,
        metadata={
            "help": "On CUDA, run decode steps eagerly instead of replaying captured CUDA graphs "
            "(worker/cuda_graphs.py; no graph pool is reserved). No effect on CPU, which never "
            "captures graphs."
        },
    )
    block_size: int = field(default=16, metadata={"help": "Tokens per KV block."})
    max_model_len: int | None = field(
        default=None,
        metadata={
            "help": "Longest prompt + output, in tokens as vLLM takes them (4096, 4k = 4,000, 4K = 4,096); "
            "-1 or auto (the default): the model's context length."
        },
    )
    max_num_seqs: int = field(default=128, metadata={"help": "Most requests running in one step."})
    max_num_batched_tokens: int = field(
        default=512, metadata={"help": "Token budget of one step (prefill chunks + decode tokens)."}
    )
    long_prefill_token_threshold: int = field(
        default=0,
        metadata={
            "help": "While requests decode, at most this many prefill tokens per step (long prompts "
            "then arrive a chunk per step and inter-token latency stays steady); 0: no cap."
        },
    )
    seed: int = field(
        default=0, metadata={"help": "Seed for requests that sample without a seed of their own."}
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata={"help": "Reuse the KV blocks of prompt prefixes seen before (--no-enable-prefix-caching)."},
    )
    quantization: str | None = field(
        default=None,
        metadata={
            "help": (
                "Weight-only quantization of the projections, done while loading: int8 (per channel), "
                "int4 (groups of 32, scale + zero point) or fp8 (e4m3, per channel). Default: none."
            )
        },
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": (
                "KV cache elements: auto (the compute dtype), fp8_e4m3 or int8 (1 byte each plus a "
                "scale per token and head: about 2x the tokens of bf16, 3.9x of fp32, same memory)."
            )
        },
    )
    scheduling_policy: str = field(
        default="fcfs",
        metadata={"help": "fcfs, or priority (a request's lower `priority` runs sooner; ties by arrival)."},
    )
    generation_config: str = field(
        default="auto",
        metadata={
            "help": (
                "Sampling defaults, as vLLM's: auto (the model's generation_config.json: temperature, "
                "top_p, top_k, min_p, repetition_penalty, max_new_tokens for a request that leaves "
                "them unset), vllm (neutral defaults), or a directory holding a generation_config.json "
                "(its max_new_tokens also caps a server request's larger max_tokens, as vLLM's)."
            )
        },
    )
    speculative_method: str | None = field(
        default=None,
        metadata={
            "help": (
                "Speculative decoding: 'ngram' (propose from the request's own earlier tokens) or "
                "'draft' (a smaller model, --speculative-model). Off by default."
            )
        },
    )
    speculative_model: str | None = field(
        default=None,
        metadata={"help": "The draft model for --speculative-method draft (same tokenizer as the target)."},
    )
    num_speculative_tokens: int = field(
        default=4, metadata={"help": "Most tokens proposed per request per step."}
    )
    speculative_ngram_min: int = field(
        default=2, metadata={"help": "Shortest n-gram the ngram proposer matches."}
    )
    speculative_ngram_max: int = field(
        default=4, metadata={"help": "Longest n-gram the ngram proposer tries first."}
    )

    # [parallel] flat here so each is a CLI flag and an LLM(...) keyword; `parallel` is the section.
    tensor_parallel_size: int = field(
        default=1,
        metadata={"help": "Ranks the model is split over (heads, MLP, vocabulary); one process each."},
    )
    pipeline_parallel_size: int = field(
        default=1,
        metadata={
            "help": (
                "Pipeline stages: the decoder layers split into runs, one process each, activations "
                "sent between them, one batch stream per stage in flight."
            )
        },
    )
    data_parallel_size: int = field(
        default=1,
        metadata={
            "help": (
                "Engine replicas behind one server (kvserve serve; each its own core process, KV pool "
                "and share of the CPU threads); requests are routed by --routing-policy."
            )
        },
    )
    distributed_executor_backend: str = field(
        default="mp",
        metadata={
            "help": (
                "How ranks run when there is more than one: mp (local processes) or ray (actors on the "
                "Ray cluster at RAY_ADDRESS, or the one `ray start` left on this machine)."
            )
        },
    )

    kv_transfer_config: str | None = field(
        default=None,
        metadata={
            "help": (
                'Prefill/decode disaggregation, as JSON: {"kv_connector": "tcp" | "shm" | "disk", '
                '"kv_role": "kv_producer" | "kv_consumer" | "kv_both", ...} (docs/DISAGGREGATION.md).'
            )
        },
    )

    def __post_init__(self) -> None:
        _ = self.parallel  # validates the parallel section
        if self.kv_transfer is not None and (self.parallel.world_size > 1 or self.data_parallel_size > 1):
            raise ValueError("kv_transfer_config: runs with tensor, pipeline and data parallel sizes 1 only")
        if self.parallel.world_size > 1 and self.speculative_method == "draft":
            raise ValueError(
                "speculative_method: 'draft' runs with tensor_parallel_size and pipeline_parallel_size 1 only"
            )
        if self.dtype not in _DTYPES:
            vllm_dtype(str(self.dtype))  # says why (float16: not supported)
            raise ValueError(f"dtype: {self.dtype!r}: use {_DTYPES_SAID}")  # a vLLM spelling left unmapped
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        # torch's generator range: past it, "Overflow when unpacking long long" once the model loaded
        if not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed: must fit a 64-bit integer, got {self.seed}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold: must be >= 0, got {self.long_prefill_token_threshold}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len: must be >= 1, got {self.max_model_len}")
        from kvserve.model.format_names import check_kv_cache_dtype, check_method

        self.quantization = check_method(self.quantization)
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy: {self.scheduling_policy!r} is not one of fcfs, priority")
        gen = self.generation_config
        if gen not in ("auto", "vllm") and not os.path.isfile(os.path.join(gen, "generation_config.json")):
            raise ValueError(
                f"generation_config: {gen!r} is not auto, vllm or a directory holding generation_config.json"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.speculative_method not in (None, "ngram", "draft"):
            raise ValueError(f"speculative_method: {self.speculative_method!r} is not one of ngram, draft")
        if self.speculative_method == "draft" and not self.speculative_model:
            raise ValueError("speculative_model: required with speculative_method 'draft'")
        if self.speculative_model and self.speculative_method != "draft":
            raise ValueError("speculative_model: only used with --speculative-method draft")
        for name in ("num_speculative_tokens", "speculative_ngram_min"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.speculative_ngram_max < self.speculative_ngram_min:
            raise ValueError(
                f"speculative_ngram_max: {self.speculative_ngram_max} is below speculative_ngram_min "
                f"{self.speculative_ngram_min}"
            )
        if self.kv_cache_memory is not None:
            try:
                parse_memory_size(self.kv_cache_memory)
            except ValueError as e:
                raise ValueError(f"kv_cache_memory: {e}") from None

    @property
    def kv_transfer(self) -> KVTransferConfig | None:
        return parse_kv_transfer_config(self.kv_transfer_config)

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(
            self.tensor_parallel_size, self.pipeline_parallel_size, self.data_parallel_size,
            self.distributed_executor_backend,
        )  # fmt: skip

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, _DTYPES[self.dtype])

    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
