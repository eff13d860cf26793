"""A tiny Hugging Face model directory written as a GGUF file, laid out as llama.cpp's
convert_hf_to_gguf.py writes one: its tensor names, float32 tensors, the rows of Q and K
permuted for the interleaved rotary of the `llama` architecture only (llama.cpp runs
`qwen2` with NEOX rotary and keeps Hugging Face's rows), llama3 rope scaling as a
`rope_freqs` tensor, and a byte-level BPE vocabulary."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable

import numpy as np
import torch

_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(rope: dict, theta: float, head_dim: int) -> np.ndarray:
    """The divisor of each rotary frequency llama.cpp stores for llama3 scaling: 1 for short
    wavelengths, `factor` for long ones, the interpolation's inverse between."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _tensor_name(name: str) -> str | None:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    parts = name.split(".")  # model.layers.N.<module>.<proj>.weight|bias
    module = ".".join(parts[3:-1])
    return f"blk.{parts[2]}.{_NAMES[module]}.{parts[-1]}" if module in _NAMES else None


def write_gguf(
    hf_dir: str,
    out_path: str,
    more: Callable | None = None,
    pre: str = "default",
    add_bos: bool | None = False,
) -> str:
    """Writes `hf_dir`'s model and tokenizer as a GGUF file at `out_path`; `more` adds
    metadata to the writer; `pre` is tokenizer.ggml.pre, and add_bos None writes no
    tokenizer.ggml.add_bos_token."""
    import gguf
    from safetensors.torch import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = cfg["model_type"]  # llama or qwen2 (llama.cpp writes Mistral as llama)
    gguf_arch = "llama" if arch == "mistral" else arch
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(out_path, gguf_arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(cfg.get("rope_theta") or rope["rope_theta"])
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])

    tok = json.load(open(os.path.join(hf_dir, "tokenizer.json")))
    vocab = tok["model"]["vocab"]
    tokens = [""] * cfg["vocab_size"]
    for piece, i in vocab.items():
        tokens[i] = piece
    specials = {t["id"] for t in tok["added_tokens"]}
    types = []
    for i in range(len(tokens)):
        if not tokens[i]:
            tokens[i] = f"[PAD{i}]"
            types.append(gguf.TokenType.UNUSED)
        else:
            types.append(gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if more is not None:
        more(w)

    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(rope, theta, head_dim))
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    for name, t in state.items():
        gname = _tensor_name(name)
        if gname is None:
            continue
        a = t.to(torch.float32).numpy()
        if gguf_arch == "llama" and ".attn_q." in gname:
            a = _permute(a, heads)
        elif gguf_arch == "llama" and ".attn_k." in gname:
            a = _permute(a, kv_heads)
        w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path
