"""The shape of a Llama-family decoder, independent of where its weights come from.

Both loaders (GGUF and Hugging Face directories) produce one of these, so the model code
and the KV-cache sizing read a single description.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
GATED_ACTIVATIONS = ("silu", "swish")  # transformers' ACT2FN: both are SiLU
MISTRAL_QWEN2_WINDOW = 4096  # MistralConfig's and Qwen2Config's sliding_window where a file has none
QWEN2_MAX_WINDOW_LAYERS = 28  # Qwen2Config's max_window_layers where a file has none
# The keys transformers requires of each rope scaling (its rope validation refuses a config
# without them); kvserve's yarn defaults its factor from the lengths.
REQUIRED_ROPE_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}
# Each config class's max_position_embeddings where a file has none (LlamaConfig's,
# MistralConfig's, Qwen2Config's): the context, and the original length llama3 / yarn default to.
DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768}
# MistralConfig's and Qwen2Config's num_key_value_heads where a file has none (LlamaConfig's,
# and every class's for an explicit null: the query heads).
DEFAULT_KV_HEADS = {"mistral": 8, "qwen2": 32}


@dataclass(frozen=True)
class ModelArch:
    """Hyper-parameters of a Llama-architecture model (Llama 2/3, Mistral, Qwen2, SmolLM2)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q, k, v (Qwen2; Llama's attention_bias)
    o_proj_bias: bool = False  # Llama's attention_bias biases o_proj too (Qwen2's does not)
    mlp_bias: bool = False  # Llama's mlp_bias: gate, up and down
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    """Some layers attend to only this many latest positions (Mistral v0.1, Qwen2 with
    use_sliding_window). kvserve attends to all of them, which is the same attention while a
    sequence is at most this long: the engine caps max_model_len here."""

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], eos_extra: tuple[int, ...] = ()) -> ModelArch:
        """Build from a Hugging Face config.json dictionary."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; kvserve supports {SUPPORTED_ARCHITECTURES}"
            )
        quant = cfg.get("quantization_config")
        if quant:
            # Its tensors (qweight / scales, fp8 codes) were refused one by one, by name, with no
            # word of why.
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
            raise ValueError(
                f"unsupported pre-quantized checkpoint (quantization_config: {method}); kvserve loads "
                "float weights and quantizes them itself (--quantization int8 | int4 | fp8)"
            )
        act = cfg.get("hidden_act", "silu")
        if act not in GATED_ACTIVATIONS:
            # The MLP is silu(gate) * up everywhere (fused kernels included): another
            # activation ran as SiLU, silently giving other tokens than transformers.
            raise ValueError(f"unsupported hidden_act {act!r}; kvserve runs {GATED_ACTIVATIONS}")
        heads = cfg["num_attention_heads"]
        theta, rope, max_positions = rope_of(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return cls(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads_of(cfg, model_type, heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias_of(cfg, model_type),
            o_proj_bias=model_type == "llama" and bool(cfg.get("attention_bias", False)),
            mlp_bias=model_type == "llama" and bool(cfg.get("mlp_bias", False)),
            rope_scaling=rope,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(eos_ids + eos_extra)),
            sliding_window=sliding_window_of(cfg, model_type),
        )


def rope_of(cfg: dict[str, Any], default_positions: int = 2048) -> tuple[float, dict[str, Any], int]:
    """(rope_theta, rope scaling with its rope_type, the context) as transformers reads them:
    >= 5 keeps them in "rope_parameters", older files in "rope_theta" + "rope_scaling". The
    context is max_position_embeddings (where the file has none, its config class's default:
    2048 for every architecture cut Mistral's and Qwen2's contexts), or for yarn (static: the
    same scaling at every length) the original length times its factor where that is longer,
    as vLLM serves it. `default_positions` stands for an architecture transformers' table here
    does not name."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope["rope_type"] = rope_type
    missing = [key for key in REQUIRED_ROPE_KEYS.get(rope_type, ()) if rope.get(key) is None]
    if missing:
        # A bare KeyError ('factor') from the rotary tables, after the weights were read.
        raise ValueError(f"rope scaling {rope_type!r} without its {', '.join(missing)}")
    max_positions = cfg.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS.get(
        cfg.get("model_type"), default_positions
    )
    if rope_type in ("llama3", "yarn"):  # transformers' standardize_rope_params
        original = cfg.get("original_max_position_embeddings")
        rope["original_max_position_embeddings"] = original or rope.get(
            "original_max_position_embeddings", max_positions
        )
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if rope_type != "default" and partial != 1.0:
        # transformers' default rope reads no partial_rotary_factor (every dimension rotates, as
        # here), its scaled ropes build tables for that part of each head, which its attention
        # then fails to apply; kvserve rotated all of it, a model no reference runs.
        raise ValueError(
            f"unsupported {rope_type} rope scaling over part of each head (partial_rotary_factor {partial})"
        )
    if rope_type == "yarn":
        scaled = rope["original_max_position_embeddings"] * (rope.get("factor") or 1.0)
        max_positions = max(max_positions, int(scaled))
    return float(theta), rope, max_positions


def kv_heads_of(cfg: dict[str, Any], model_type: str, heads: int) -> int:
    """num_key_value_heads as transformers reads it: a Mistral or Qwen2 config without the key
    has its class's default (8, 32), not the query heads (a Mistral checkpoint with 8 KV heads
    was refused with "weight shard: 32 rows, expected 64"); a count the query heads are no
    multiple of, which transformers' attention cannot group, is refused naming both."""
    kv = cfg["num_key_value_heads"] if "num_key_value_heads" in cfg else DEFAULT_KV_HEADS.get(model_type)
    kv = kv or heads
    if heads % kv:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    return kv


def qkv_bias_of(cfg: dict[str, Any], model_type: str) -> bool:
    """Whether q, k and v carry biases, as transformers builds the layers: Qwen2's always,
    Mistral's never, Llama's as attention_bias says. (An attention_bias key in a Qwen2 or
    Mistral config is not read there: Qwen2's false refused its own biased checkpoint.)"""
    if model_type == "qwen2":
        return True
    return model_type == "llama" and bool(cfg.get("attention_bias", False))


def sliding_window_of(cfg: dict[str, Any], model_type: str) -> int | None:
    """The window of the layers that slide, as transformers reads the config: every Mistral
    layer (its default window, 4096, where the file names none; layer_types are not read for
    Mistral); Qwen2's only under use_sliding_window (else its window is None), the layers
    layer_types marks, or without them those from max_window_layers (default 28) on; never
    Llama's. A Qwen2 listing sliding layers without use_sliding_window attends to everything.
    Other architectures (the planner's): the layers layer_types marks."""
    if model_type == "mistral":
        return cfg.get("sliding_window", MISTRAL_QWEN2_WINDOW) or None
    if model_type == "llama" or (model_type == "qwen2" and not cfg.get("use_sliding_window")):
        return None
    window = cfg.get("sliding_window", MISTRAL_QWEN2_WINDOW if model_type == "qwen2" else None)
    if not window:
        return None
    types = cfg.get("layer_types")
    if types is not None:
        return window if "sliding_attention" in types else None
    if model_type != "qwen2":
        return None
    first = cfg.get("max_window_layers", QWEN2_MAX_WINDOW_LAYERS)
    return window if first < cfg["num_hidden_layers"] else None
