"""Model shapes for `kvserve plan`: built-in presets, HF config.json, GGUF metadata.

Sizing needs only shapes, never weights, so a plan can be made for a model that is
not downloaded. Parameter counts are computed from the shapes (Llama-style
decoder: gated MLP, RMSNorm, optional MoE and DeepSeek MLA attention) rather than
copied from model cards, so presets, HF dirs and GGUF files are treated alike.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.model.arch import rope_of, sliding_window_of


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only transformer.

    MoE: layers after the first `num_dense_layers` hold `num_experts` routed experts
    of width `expert_intermediate_size` (top-`experts_per_token`) plus
    `num_shared_experts` always-on experts. MLA (`kv_lora_rank` > 0): `head_dim` is
    the no-RoPE query/key head width and the cache holds one latent of
    `kv_lora_rank + rope_head_dim` per layer.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    max_context: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    num_shared_experts: int = 0
    num_dense_layers: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_head_dim: int = 0
    v_head_dim: int = 0
    source: str = "preset"

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def cache_kv_heads(self) -> int:
        """KV heads as the shared `kv_bytes_per_token` formula sees them."""
        return 1 if self.kv_lora_rank else self.num_kv_heads

    @property
    def cache_head_dim(self) -> int:
        """MLA stores one latent (not K and V), so it is passed as one head of half
        its width: 2 * (width / 2) gives the latent size in the shared formula."""
        if self.kv_lora_rank:
            return (self.kv_lora_rank + self.rope_head_dim) // 2
        return self.head_dim

    def attention_params(self) -> int:
        h, n, d = self.hidden_size, self.num_heads, self.head_dim
        if self.kv_lora_rank:
            qk = d + self.rope_head_dim
            q = h * n * qk
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * qk
            kv_a = h * (self.kv_lora_rank + self.rope_head_dim) + self.kv_lora_rank
            kv_b = self.kv_lora_rank * n * (d + self.v_head_dim)
            return q + kv_a + kv_b + n * self.v_head_dim * h
        kv = self.num_kv_heads * d
        bias = (n * d + 2 * kv) if self.qkv_bias else 0
        return 2 * h * n * d + 2 * h * kv + bias

    def mlp_params(self, width: int) -> int:
        return 3 * self.hidden_size * width  # gate, up, down

    def _layer_params(self, active: bool) -> tuple[int, int]:
        """(dense layer, MoE layer) parameter counts."""
        base = self.attention_params() + 2 * self.hidden_size
        dense = base + self.mlp_params(self.intermediate_size)
        if not self.is_moe:
            return dense, dense
        experts = self.experts_per_token if active else self.num_experts
        n = experts + self.num_shared_experts
        moe = base + self.hidden_size * self.num_experts
        return dense, moe + n * self.mlp_params(self.expert_intermediate_size)

    @property
    def embedding_params(self) -> int:
        """Embedding table plus untied lm_head (kept 16-bit when quantised)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)

    def _params(self, active: bool) -> int:
        dense, moe = self._layer_params(active)
        n_dense = self.num_dense_layers if self.is_moe else self.num_layers
        body = n_dense * dense + (self.num_layers - n_dense) * moe
        return self.embedding_params + body + self.hidden_size

    @property
    def total_params(self) -> int:
        return self._params(active=False)

    @property
    def active_params(self) -> int:
        """Parameters one token goes through (all of them for a dense model)."""
        return self._params(active=True)

    @property
    def expert_params(self) -> int:
        """Routed-expert weights of all MoE layers (the part decode reads sparsely)."""
        if not self.is_moe:
            return 0
        per_layer = self.num_experts * self.mlp_params(self.expert_intermediate_size)
        return (self.num_layers - self.num_dense_layers) * per_layer


def _llama(name: str, *shape: int, **kw: Any) -> ModelSpec:
    """shape: layers, hidden, heads, kv_heads, vocab, ffn, context."""
    layers, hidden, heads, kv_heads, vocab, ffn, ctx = shape
    head_dim = kw.pop("head_dim", hidden // heads)
    return ModelSpec(name, layers, hidden, heads, kv_heads, head_dim, vocab, ffn, ctx, **kw)


def _moe(experts: int, top_k: int, width: int, shared: int = 0, dense: int = 0) -> dict:
    return {
        "num_experts": experts,
        "experts_per_token": top_k,
        "expert_intermediate_size": width,
        "num_shared_experts": shared,
        "num_dense_layers": dense,
    }


_DEEPSEEK_MLA = {
    "head_dim": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "rope_head_dim": 64,
    "v_head_dim": 128,
}

# Published config.json shapes (HF hub); Mistral-7B is v0.3 (32768 vocab).
# fmt: off
PRESETS: dict[str, ModelSpec] = {m.name: m for m in (
    _llama("SmolLM2-135M", 30, 576, 9, 3, 49152, 1536, 8192, tie_embeddings=True),
    _llama("Llama-3.1-8B", 32, 4096, 32, 8, 128256, 14336, 131072),
    _llama("Llama-3.3-70B", 80, 8192, 64, 8, 128256, 28672, 131072),
    _llama("Llama-3.1-405B", 126, 16384, 128, 8, 128256, 53248, 131072),
    _llama("Qwen2.5-7B", 28, 3584, 28, 4, 152064, 18944, 32768, qkv_bias=True),
    _llama("Qwen2.5-72B", 80, 8192, 64, 8, 152064, 29568, 32768, qkv_bias=True),
    _llama("Mistral-7B", 32, 4096, 32, 8, 32768, 14336, 32768),
    _llama("Mixtral-8x7B", 32, 4096, 32, 8, 32000, 14336, 32768, **_moe(8, 2, 14336)),
    _llama("DeepSeek-V3", 61, 7168, 128, 128, 129280, 18432, 163840,
           **_moe(256, 8, 2048, shared=1, dense=3), **_DEEPSEEK_MLA),
)}
# fmt: on


def _norm(name: str) -> str:
    name = name.rsplit("/", 1)[-1].lower()
    return re.sub(r"[-_.](instruct|chat|it|base)$", "", name).replace("_", "-")


def find_preset(name: str) -> ModelSpec | None:
    """Preset by name, case-insensitive, hub org prefix and -Instruct ignored."""
    table = {_norm(k): v for k, v in PRESETS.items()}
    table.update(
        {
            "llama-3.1-70b": PRESETS["Llama-3.3-70B"],
            "mistral-7b-v0.3": PRESETS["Mistral-7B"],
        }
    )
    return table.get(_norm(name))


def from_hf_config(cfg: dict[str, Any], name: str = "hf") -> ModelSpec:
    """Build a spec from a HF config.json dict (Llama/Qwen/Mistral/Mixtral/DeepSeek)."""
    cfg = {**cfg, **cfg.get("text_config", {})}
    h, n = cfg["hidden_size"], cfg["num_attention_heads"]
    experts = cfg.get("num_local_experts") or cfg.get("n_routed_experts") or cfg.get("num_experts") or 0
    moe_ff = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    shared = cfg.get("n_shared_experts") or 0
    if cfg.get("shared_expert_intermediate_size"):
        shared = cfg["shared_expert_intermediate_size"] // moe_ff
    mla = bool(cfg.get("kv_lora_rank"))
    return ModelSpec(
        name=name,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=h,
        num_heads=n,
        num_kv_heads=cfg.get("num_key_value_heads") or n,
        head_dim=(cfg.get("qk_nope_head_dim") if mla else cfg.get("head_dim")) or h // n,
        vocab_size=cfg["vocab_size"],
        intermediate_size=cfg["intermediate_size"],
        max_context=_context(cfg),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias") or cfg.get("model_type", "").startswith("qwen2")),
        num_experts=experts,
        experts_per_token=(cfg.get("num_experts_per_tok") or 0) if experts else 0,
        expert_intermediate_size=moe_ff if experts else 0,
        num_shared_experts=shared if experts else 0,
        num_dense_layers=(cfg.get("first_k_dense_replace") or 0) if experts else 0,
        q_lora_rank=cfg.get("q_lora_rank") or 0,
        kv_lora_rank=cfg.get("kv_lora_rank") or 0,
        rope_head_dim=cfg.get("qk_rope_head_dim") or 0,
        v_head_dim=cfg.get("v_head_dim") or 0,
        source="config.json",
    )


def _context(cfg: dict[str, Any]) -> int:
    """The longest sequence the engine serves: max_position_embeddings (a yarn model's scaled
    length where longer), cut to a sliding attention window where the model has one (the
    engine stops there too, model/arch.py)."""
    try:
        context = rope_of(cfg, default_positions=4096)[2]
    except ValueError:
        context = cfg.get("max_position_embeddings") or 4096
    window = sliding_window_of(cfg, cfg.get("model_type", ""))
    return min(context, window) if window else context


def from_gguf(path: str | Path) -> ModelSpec:
    """Build a spec from GGUF metadata (`{arch}.block_count` etc.); reads no tensors. The parse
    is the engine's (model/loader/gguf_file.py): 3.4x faster than `gguf.GGUFReader`'s own, and
    shared with a load of the same file in this process."""
    from kvserve.model.loader.gguf_file import gguf_reader

    reader = gguf_reader(str(path))

    def get(key: str, default: Any = None) -> Any:
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = get("general.architecture")
    for key in ("block_count", "embedding_length", "attention.head_count", "feed_forward_length"):
        if not _positive_int(get(f"{arch}.{key}")):  # was a TypeError traceback
            raise ValueError(f"{str(path)!r}: GGUF metadata without the model's shape (no {arch}.{key})")
    h, n = get(f"{arch}.embedding_length"), get(f"{arch}.attention.head_count")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = get(f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else 0)
    if not vocab:
        raise ValueError(f"{str(path)!r}: GGUF metadata without a vocabulary size")
    experts = get(f"{arch}.expert_count", 0)
    ff = get(f"{arch}.feed_forward_length")
    return ModelSpec(
        name=get("general.name") or Path(path).stem,
        num_layers=get(f"{arch}.block_count"),
        hidden_size=h,
        num_heads=n,
        num_kv_heads=get(f"{arch}.attention.head_count_kv") or n,
        head_dim=get(f"{arch}.attention.key_length") or h // n,
        vocab_size=vocab,
        intermediate_size=ff,
        max_context=get(f"{arch}.context_length", 4096),
        tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        num_experts=experts,
        experts_per_token=get(f"{arch}.expert_used_count", 0) if experts else 0,
        expert_intermediate_size=(get(f"{arch}.expert_feed_forward_length") or ff) if experts else 0,
        source="gguf",
    )


# the shape a plan is computed from: a config.json or GGUF without one of them was a KeyError
# or TypeError traceback
_HF_SHAPE = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_hf_config(cfg: dict[str, Any], where: str) -> None:
    """ValueError naming the first field of the shape that is missing or no positive integer."""
    for key in _HF_SHAPE:
        if key not in cfg:
            raise ValueError(f"{where!r}: no {key}, one of the model's shape ({', '.join(_HF_SHAPE)})")
        if not _positive_int(cfg[key]):
            raise ValueError(f"{where!r}: {key} must be a positive integer, got {cfg[key]!r}")


def load_model_spec(model: str) -> ModelSpec:
    """Resolve MODEL: a preset name, a HF directory / config.json, or a .gguf file."""
    preset = find_preset(model)
    if preset is not None:
        return preset
    path = Path(model)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file() and path.suffix == ".gguf":
        return from_gguf(path)
    if path.is_file() and path.suffix == ".json":
        try:
            cfg = json.loads(path.read_text())
        except ValueError as e:  # was json's bare "Expecting value: line 1 column 1 (char 0)"
            raise ValueError(f"{str(path)!r}: not JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{str(path)!r}: not a JSON object")
        _check_hf_config({**cfg, **(cfg.get("text_config") or {})}, str(path))
        return from_hf_config(cfg, name=path.parent.name)
    known = ", ".join(PRESETS)
    raise ValueError(f"{model!r} is not a preset, HF model dir or .gguf file; presets: {known}")
