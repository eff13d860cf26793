"""The shape the config gives each checkpoint tensor, checked as the tensor arrives.

Without it a config that disagrees with its checkpoint failed deep in the loader with no tensor
named ("weight shard: 128 rows, expected 96 or 96"), or, where only a dimension the loader does
not slice differed (hidden_size), loaded and ran the checkpoint's own shapes under a config
that describes another model; transformers refuses both, naming the tensor.
"""

from __future__ import annotations

import re

from kvserve.model.arch import ModelArch

_LAYER = re.compile(r"model\.layers\.\d+\.(.+)\.(weight|bias)")


def expected_shape(arch: ModelArch, name: str) -> tuple[tuple[int, ...], str] | None:
    """(the whole tensor's shape, the config fields it comes from) for a checkpoint tensor
    name, or None for a name this table does not cover."""
    hidden, inter = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    q_fields = "num_attention_heads x head_dim, hidden_size"
    kv_fields = "num_key_value_heads x head_dim, hidden_size"
    top = {
        "model.embed_tokens.weight": ((arch.vocab_size, hidden), "vocab_size, hidden_size"),
        "lm_head.weight": ((arch.vocab_size, hidden), "vocab_size, hidden_size"),
        "model.norm.weight": ((hidden,), "hidden_size"),
    }
    if name in top:
        return top[name]
    m = _LAYER.fullmatch(name)
    if m is None:
        return None
    module, kind = m.groups()
    matrices = {
        "self_attn.q_proj": ((q, hidden), q_fields),
        "self_attn.k_proj": ((kv, hidden), kv_fields),
        "self_attn.v_proj": ((kv, hidden), kv_fields),
        "self_attn.o_proj": ((hidden, q), "hidden_size, num_attention_heads x head_dim"),
        "mlp.gate_proj": ((inter, hidden), "intermediate_size, hidden_size"),
        "mlp.up_proj": ((inter, hidden), "intermediate_size, hidden_size"),
        "mlp.down_proj": ((hidden, inter), "hidden_size, intermediate_size"),
        "input_layernorm": ((hidden,), "hidden_size"),
        "post_attention_layernorm": ((hidden,), "hidden_size"),
    }
    if module not in matrices:
        return None
    shape, fields = matrices[module]
    if kind == "bias":  # a projection's bias: its output rows
        return shape[:1], fields.split(",")[0]
    return shape, fields


def check_shape(arch: ModelArch, name: str, shape: tuple[int, ...], sliced: bool) -> None:
    """Refuse a tensor whose shape is not the config's. `sliced`: a tensor-parallel rank may
    hold a slice of it, along one dimension (tp_sharding decides which; take_rows /
    take_cols check that one)."""
    want = expected_shape(arch, name)
    if want is None:
        return
    whole, fields = want
    differing = sum(a != b for a, b in zip(shape, whole)) + abs(len(shape) - len(whole))
    if differing == 0 or (sliced and differing == 1 and len(shape) == len(whole)):
        return
    raise ValueError(f"{name}: shape {list(shape)} where the config gives {list(whole)} ({fields})")
