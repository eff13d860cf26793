"""Llama-architecture decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Takes flat token tensors (all requests of a step concatenated) and knows nothing about
scheduling. q/k/v and gate/up projections are fused into single matmuls at load time. Under
tensor parallelism each projection and the vocabulary table hold this rank's shard
(model/layers/parallel_linear.py); with one rank they are the whole matrices. Under
pipeline parallelism a stage builds and loads only its run of decoder layers; the first
stage holds the embedding, the last the lm_head (and the embedding table when tied); the
final norm (a vector) is on every stage. The residual stream is the one tensor `x` (each
layer adds into it), so it is all a stage hands to the next.

With `quantization` set, each projection is quantized as its layer completes during loading
(so the float copy of the whole model never exists) and runs through QuantizedLinear. The
embedding table and lm_head use int8 (fp8 under `fp8`), also under int4: the output layer is
the most sensitive to rounding, and a tied table must also serve row lookups.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed.parallel_state import get_pp_group, get_tp_group
from kvserve.model.arch import ModelArch
from kvserve.model.layers.attention import NO_SCALES, AttentionMetadata, PagedAttention
from kvserve.model.layers.parallel_linear import (
    MergedColumnParallelLinear,
    ParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    take_rows,
)
from kvserve.model.layers.quantization import QWeight
from kvserve.model.layers.quantized_linear import NativeMatmul, QuantizedLinear
from kvserve.model.layers.rotary import RotaryEmbedding, apply_rotary
from kvserve.model.layers.tp_sharding import even_shard
from kvserve.model.models.weight_shapes import check_shape

# Activation dtypes the fused layer ops (csrc/layer_ops_cpu.cpp, triton_layer_ops.py) take; others run
# the torch path.
FUSED_DTYPES = (torch.float32, torch.bfloat16)
# Decode steps of up to this many rows run the stack in one parallel region, the weight stream
# overlapping the serial work (csrc/decode_overlap_cpu.cpp). Until the region's threads shared the
# attention, one row (round 17: at 2 and 4 rows thread 0's attention outweighed the overlap);
# with it, 2 to 16 rows took 0.83-0.94x the time of a region per kernel (round 29, Zen 4); with
# the serial work shared by rows from SPLIT_ROWS up, 16 to 64 rows 0.86-0.97x, 128 rows 1.02x
# (round 30, an AMX Xeon; int4 weights, int8 KV, 2 threads; docs/BENCHMARKS.md issue 16).
OVERLAP_MAX_ROWS = 64
# Overlapped steps of at least this many rows split thread 0's serial work (norms, rotary, KV
# writes, activation quantization) between the threads by rows: it grows with the rows and, from
# here up, outweighs the weight loading it overlaps (at 8 rows either way, round 30).
SPLIT_ROWS = 8
STACK_KV_DTYPES = (torch.float32, torch.int8, torch.float8_e4m3fn)  # the caches the decode stack reads
NO_BIAS = torch.empty(0)  # what the decode stack is given for a projection without a bias


def add_stack_layer(stack, input_norm: torch.Tensor, post_norm: torch.Tensor, calls: list[NativeMatmul],
                    biases: list[torch.Tensor | None],
                    kv_scales: tuple[torch.Tensor, torch.Tensor] | None) -> None:  # fmt: skip
    """One decoder layer into a C++ DecodeStack: its norms, its four projections (qkv, o,
    gate_up, down) with their biases (None: none), and its 1-byte KV cache's scales, if any."""
    ks, vs = kv_scales or (NO_SCALES, NO_SCALES)
    biases = [NO_BIAS if b is None else b.detach() for b in biases]
    weights = [t for c in calls for t in (c.codes, c.scales)]
    panels = [c.panels for c in calls]
    quantize = calls[0].quantize if all(panels) and len({c.quantize for c in calls}) == 1 else 0
    if not quantize:
        panels = []  # the overlapped path needs every projection's panel-range form from one module
    addresses, rows = [c.address for c in calls], [c.out_features for c in calls]
    stack.add_layer(input_norm, post_norm, addresses, weights, rows, ks, vs, panels, quantize, biases)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 then cast back, as the reference does."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        h, hd = arch.hidden_size, arch.head_dim
        self.head_dim = hd
        self.eps = arch.rms_norm_eps
        self.qkv_proj = QKVParallelLinear(h, arch.num_heads, arch.num_kv_heads, hd, arch.attention_bias)
        shard = self.qkv_proj.shard  # this rank's heads (all of them without tensor parallelism)
        self.num_heads, self.num_kv_heads = shard.num_q, shard.num_kv
        self.q_size, self.kv_size = shard.num_q * hd, shard.num_kv * hd
        q_cols = (shard.q_start * hd, (shard.q_start + shard.num_q) * hd)
        self.o_proj = RowParallelLinear(*q_cols, arch.num_heads * hd, h, arch.o_proj_bias)
        self.gate_up_proj = MergedColumnParallelLinear(h, arch.intermediate_size, arch.mlp_bias)
        tp = get_tp_group()
        self.down_proj = RowParallelLinear(*even_shard(arch.intermediate_size, tp.size, tp.rank),
                                           arch.intermediate_size, h, arch.mlp_bias)  # fmt: skip
        self.input_norm = nn.Parameter(torch.empty(h), requires_grad=False)
        self.post_attn_norm = nn.Parameter(torch.empty(h), requires_grad=False)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, hd)
        self.ops = None  # the small ops' kernels once the model runner loads them (use_layer_ops)

    def projections(self) -> dict[str, ParallelLinear]:
        return {"qkv": self.qkv_proj, "o": self.o_proj, "gate_up": self.gate_up_proj, "down": self.down_proj}

    @property
    def quant(self) -> dict[str, QuantizedLinear]:
        """The projections that run quantized, by name."""
        return {n: p.quant for n, p in self.projections().items() if p.quant is not None}

    def pack_weights(self) -> None:
        for p in self.projections().values():
            p.pack()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        if self.ops is not None and x.dtype in FUSED_DTYPES:
            return self._forward_fused(x, cos, sin, meta, k_cache, v_cache)
        n = x.shape[0]
        h = rms_norm(x, self.input_norm, self.eps)
        qkv = self.qkv_proj(h)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        attn = self.attn.forward(q, k, v, k_cache, v_cache, meta)
        x = x + self.o_proj(attn.reshape(n, self.q_size))
        h = rms_norm(x, self.post_attn_norm, self.eps)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)

    def _forward_fused(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
        k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The same layer with its small ops fused (one call each where the torch path
        dispatches ~20 ATen ops: at one decoding row they cost about what the matmuls do on the
        CPU, and a third of the step on an H200): the C++ CPU kernels or the Triton ones.
        Rotary is applied in place in the qkv output, and the residual stream `x` is added
        into in place: it is this forward's own tensor (the embedding's or the last layer's)."""
        ops, n, hd = self.ops, x.shape[0], self.head_dim
        # .forward: these modules have no hooks, and nn.Module.__call__ costs microseconds a call
        qkv = self.qkv_proj.forward(ops.rms_norm(x, self.input_norm, self.eps))
        q = qkv[:, : self.q_size].view(n, self.num_heads, hd)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(n, self.num_kv_heads, hd)
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, hd)
        ops.rotary_inplace(q, cos, sin)
        ops.rotary_inplace(k, cos, sin)
        attn = self.attn.forward(q, k, v, k_cache, v_cache, meta)
        o = self.o_proj.forward(attn.reshape(n, self.q_size))
        h = ops.add_rms_norm(x, o, self.post_attn_norm, self.eps)
        return x.add_(self.down_proj.forward(ops.silu_mul(self.gate_up_proj.forward(h))))


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        pp = get_pp_group()
        self.is_first_stage, self.is_last_stage = pp.is_first, pp.is_last
        self.start_layer, self.stop_layer = pp.layer_range(arch.num_layers)
        tied = arch.tie_word_embeddings
        self.tied = tied  # cleared by load_weights where the checkpoint holds a head of its own
        self.embed = None
        if pp.is_first or (pp.is_last and tied):
            self.embed = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(self.start_layer, self.stop_layer))
        self.norm = nn.Parameter(torch.empty(arch.hidden_size), requires_grad=False)
        self.ops = None  # the small ops' kernels: C++ on the CPU, Triton on a GPU (use_layer_ops)
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size) if pp.is_last else None
        if tied and self.lm_head is not None:
            self.lm_head.tie(self.embed)
        self.rotary = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
        )
        self.quantization: str | None = None  # set by the loader before load_weights
        self.quant_device: torch.device | str = "cpu"  # the device quantized weights are packed for
        self.use_decode_stack = True  # pure-decode steps through the C++ DecodeStack where it applies
        self._stack: tuple[int, object] | None = None  # (the KV scales it was built for, stack or None)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank stores (all of them without tensor parallelism)."""
        return self.layers[0].num_kv_heads

    # The quantized table (lookups) and lm_head, None when they are float.
    embed_q = property(lambda self: self.embed.quant)
    lm_head_q = property(lambda self: self.lm_head.quant)

    def owns(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs on this pipeline stage (always, without one)."""
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m:
            return self.start_layer <= int(m.group(1)) < self.stop_layer
        if name == "model.embed_tokens.weight":
            return self.embed is not None
        if name == "lm_head.weight":
            return self.lm_head is not None
        return True

    def weight_bytes(self) -> int:
        """Bytes of the weights, each once, as held: parameters and persistent buffers, or a
        projection's oneDNN-packed matrix once it has replaced the Parameter (rotary tables are
        not included). A tied table counts once; `duplicate_weight_bytes` is its second copy."""
        tensors = {id(t): t for t in self.state_dict(keep_vars=True).values()}
        plain = sum(t.numel() * t.element_size() for t in tensors.values())
        packed = sum(p.packed_bytes() for layer in self.layers for p in layer.projections().values())
        if self.lm_head is not None and not self.lm_head.holds_both():
            packed += self.lm_head.packed_bytes()
        return plain + packed

    def duplicate_weight_bytes(self) -> int:
        """Bytes held twice: a tied table packed for the lm_head beside its plain rows (or
        their compact lookup form), and the int8 copies int4 projections hold for the dynamic
        kernel."""
        dup = sum(p.duplicate_bytes() for layer in self.layers for p in layer.projections().values())
        if self.lm_head is not None and self.lm_head.holds_both():
            dup += self.lm_head.packed_bytes()
        if self.embed is not None and self.embed.lookup is not None:
            dup += self.embed.lookup.nbytes()
        return dup

    def use_cpu_kernels(self, kernels) -> None:
        """Run attention's decodes and KV writes and the layers' small ops through the C++ CPU
        kernels (cpu_kernels.py); None keeps the torch path."""
        self.use_layer_ops(kernels)
        for layer in self.layers:
            layer.attn.kernels = kernels

    def use_layer_ops(self, ops) -> None:
        """Run the layers' small ops (norms, rotary, SiLU-and-multiply) through `ops`, the C++
        CPU kernels or, on a GPU, the Triton ones (triton_layer_ops.py), leaving attention to
        its backend; None keeps the torch path."""
        self.ops = ops
        self._stack = None
        for layer in self.layers:
            layer.ops = ops

    def _decode_stack(self, x: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor):
        """The C++ decode stack (csrc/decode_stack_cpu.cpp) for this step, or None to run the
        layers from Python: it takes pure-decode steps (prompt rows too, where the CPU backend
        laid small chunks out as decode rows) of float32 rows on the CPU, every
        projection native int4 / int8 (biased or not), one tensor-parallel rank, a float32, int8 or fp8
        KV cache. It computes exactly what the fused Python path does, without the ~35 us of
        interpreter per layer."""
        if not self.use_decode_stack or self.ops is None or type(meta) is not AttentionMetadata:
            return None  # other backends' metadata (Triton) keep their own attention
        if meta.prefills or not meta.num_decodes:
            return None
        if x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
            return None
        if kv_cache.dtype not in STACK_KV_DTYPES:
            return None
        scales = self.layers[0].attn.kv_scales  # a new pool comes with new scales (the stack holds them)
        key = scales[0].data_ptr() if scales else 0
        if self._stack is None or self._stack[0] != key:
            self._stack = (key, self._build_decode_stack())
        return self._stack[1]

    def _stack_calls(self) -> list[list[NativeMatmul]] | None:
        """Each layer's four projections as the stack calls them, or None where the stack
        cannot run this model (a float projection, tensor parallelism, no kernels). A bias is
        the stack's to add (add_stack_layer)."""
        if not hasattr(self.ops, "DecodeStack") or get_tp_group().size > 1:
            return None
        out = []
        for layer in self.layers:
            quants = [p.quant for p in layer.projections().values()]
            calls = [q.native_matmul() if q is not None else None for q in quants]
            if any(c is None for c in calls):
                return None
            out.append(calls)
        return out

    def stack_applies(self, kv_cache_dtype: torch.dtype) -> bool:
        """Whether the C++ decode stack runs this model's pure-decode steps on the CPU with a KV
        cache of `kv_cache_dtype`."""
        return (self.use_decode_stack and self.ops is not None and self.dtype == torch.float32
                and kv_cache_dtype in STACK_KV_DTYPES and self._stack_calls() is not None)  # fmt: skip

    def _build_decode_stack(self):
        layer_calls = self._stack_calls()
        if layer_calls is None:
            return None
        first = self.layers[0]
        stack = self.ops.DecodeStack(first.num_heads, first.num_kv_heads, first.head_dim, first.eps)
        for layer, calls in zip(self.layers, layer_calls):
            biases = [p.bias for p in layer.projections().values()]
            norms = (layer.input_norm, layer.post_attn_norm)
            add_stack_layer(stack, *norms, calls, biases, layer.attn.kv_scales)
        head = self.lm_head.quant.native_matmul() if self.lm_head is not None and self.lm_head.quant else None
        if head is not None:  # decode_logits: the final norm and the lm_head in the same call
            stack.set_head(self.norm, head.address, head.codes, head.scales, head.out_features, head.panels,
                           head.quantize)  # fmt: skip
        stack.set_overlap_rows(OVERLAP_MAX_ROWS)
        stack.set_split_rows(SPLIT_ROWS)
        return stack

    def pack_weights(self) -> None:
        """Prepack every float projection for oneDNN (CPU) in place of its plain weight; a
        tied table is also kept for lookups where this stage looks tokens up in it (the
        first), in its smallest exact form, unless its panels (float_panels.py) serve them."""
        for layer in self.layers:
            layer.pack_weights()
        if self.lm_head is not None:
            lookups = self.lm_head.tied and self.is_first_stage
            self.lm_head.pack(keep_plain=lookups)
            if lookups and self.lm_head.holds_both():
                self.embed.compact_lookups()  # the same Parameter: the lm_head's plain copy goes too
            elif lookups and self.lm_head.panels_serve_lookups():
                self.embed.lookups_from_panels(self.lm_head.packed)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [local layers, 2, num_blocks, block_size, kv_heads, head_dim]
        hidden_in: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states (after the last norm) for every input token; on a pipeline stage
        that is not the last, the residual stream after its layers (to hand on). Stages after
        the first start from `hidden_in`, the previous stage's."""
        x = self.embed(input_ids, self.norm.dtype) if hidden_in is None else hidden_in
        return self._run(x, positions, meta, kv_cache, logits=False)

    @torch.inference_mode()
    def decode_logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor | None:
        """Logits of every row of a step on a one-stage model (None on tensor-parallel ranks
        other than 0): forward then compute_logits, in one C++ call where the decode stack
        takes the step (its head: the final norm and the lm_head as the stack's last stage).
        The same numbers either way."""
        return self._run(self.embed(input_ids, self.norm.dtype), positions, meta, kv_cache, logits=True)

    def _run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        logits: bool,
    ) -> torch.Tensor | None:
        cos, sin = self.rotary.tables(positions, x.dtype)
        stack = self._decode_stack(x, meta, kv_cache)
        if stack is not None:
            args = (x, cos, sin, kv_cache, meta.slot_blocks, meta.slot_offsets, meta.decode_block_tables,
                    meta.decode_seq_lens, self.layers[0].attn.scale)  # fmt: skip
            if logits and stack.has_head():
                return stack.forward_logits(*args)
            x = stack.forward(*args)
        else:
            for i, layer in enumerate(self.layers):
                x = layer.forward(x, cos, sin, meta, kv_cache[i, 0], kv_cache[i, 1])
        if not self.is_last_stage:
            return x
        if self.ops is not None and x.dtype in FUSED_DTYPES:
            hidden = self.ops.rms_norm(x, self.norm, self.arch.rms_norm_eps)
        else:
            hidden = rms_norm(x, self.norm, self.arch.rms_norm_eps)
        return self.compute_logits(hidden) if logits else hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits over the whole vocabulary; None on tensor-parallel ranks other than 0
        (every rank must call it: the pieces are gathered)."""
        return self.lm_head.logits(hidden)

    def weight_slice(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(dim, start, stop) of checkpoint tensor `name` that this rank needs, so loaders can
        read only that; None for the whole tensor. Row-parallel weights are read whole when
        they will be quantized (see parallel_linear)."""
        if get_tp_group().size == 1:
            return None
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, self.embed.start, self.embed.stop
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
        if m is None:
            return None
        layer: DecoderLayer = self.layers[int(m.group(1))]
        part = {"self_attn.q_proj": (layer.qkv_proj, 0), "self_attn.k_proj": (layer.qkv_proj, 1),
                "self_attn.v_proj": (layer.qkv_proj, 2), "mlp.gate_proj": (layer.gate_up_proj, 0),
                "mlp.up_proj": (layer.gate_up_proj, 1)}.get(m.group(2))  # fmt: skip
        if part is not None:
            a, b, _ = part[0].row_runs[part[1]]
            return 0, a, b
        row = {"self_attn.o_proj": layer.o_proj, "mlp.down_proj": layer.down_proj}.get(m.group(2))
        if row is not None and self.quantization is None and len(shape) == 2:
            return 1, row.cols[0], row.cols[1]
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors (whole or this rank's slice), fusing q/k/v and
        gate/up as they arrive."""
        pending: dict[int, dict[str, torch.Tensor]] = {}
        done: set[int] = set()  # this stage's layers (local indices) whose every tensor arrived
        seen: set[str] = set()
        own_head = None  # a tied config's checkpoint lm_head.weight, kept until the embedding is here
        dtype = self.norm.dtype
        sliced = get_tp_group().size > 1
        for name, tensor in weights:
            if not self.owns(name):  # another pipeline stage's (GGUF tensors are read first)
                continue
            check_shape(self.arch, name, tuple(tensor.shape), sliced)
            if isinstance(tensor, QWeight) and not name.startswith("model.layers."):
                tensor = tensor.dequantize()
            if isinstance(tensor, torch.Tensor):
                tensor = tensor.to(dtype)
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
            if m:
                idx, rest = int(m.group(1)) - self.start_layer, m.group(2)
                if rest.endswith("rotary_emb.inv_freq"):
                    continue
                pending.setdefault(idx, {})[rest] = tensor
                if self._maybe_finish_layer(idx, pending):
                    done.add(idx)
                continue
            if name == "model.embed_tokens.weight":
                self.embed.load(tensor)
                if self.tied and self.lm_head is not None:
                    self.lm_head.tie(self.embed)
            elif name == "model.norm.weight":
                self.norm.data = tensor
            elif name == "lm_head.weight":
                if self.tied:
                    own_head = tensor
                else:
                    self.lm_head.load(tensor)
            else:
                raise ValueError(f"unexpected weight {name!r}")
            seen.add(name)
        lacking = self._missing_layer_weights(pending, done)
        if lacking:
            more = f" and {len(lacking) - 8} more layers" if len(lacking) > 8 else ""
            raise ValueError(f"missing weights: {'; '.join(lacking[:8])}{more}")
        need = {"model.norm.weight"} | ({"model.embed_tokens.weight"} if self.embed is not None else set())
        if not self.tied and self.lm_head is not None:
            need.add("lm_head.weight")
        if need - seen:
            raise ValueError(f"missing weights: {sorted(need - seen)}")
        if own_head is not None:
            self._untie_if_distinct(own_head)
        if self.quantization is not None:
            self._quantize_embeddings()

    def _quantize_embeddings(self) -> None:
        method = "fp8" if self.quantization == "fp8" else "int8"
        if self.embed is not None:
            self.embed.quantize(method, self.quant_device)
        if self.lm_head is None:
            return
        if self.tied:
            self.lm_head.tie(self.embed)
        else:
            self.lm_head.quantize(method, self.quant_device)

    def _untie_if_distinct(self, head: torch.Tensor) -> None:
        """A config that ties the head to the embedding over a checkpoint holding its own,
        different lm_head.weight: transformers (5.x) then leaves them untied and runs the
        checkpoint's head, so this does too (it ran the embedding as the head: other tokens).
        An lm_head.weight equal to the table (a .bin export's shared tensor) keeps the tie."""
        lm = self.lm_head
        if torch.equal(take_rows(head, lm.start, lm.stop, lm.vocab), self.embed.weight.data):
            return
        self.tied = False
        lm.weight = nn.Parameter(torch.empty(0, dtype=head.dtype), requires_grad=False)
        lm.quant, lm.tied = None, False
        lm.load(head)
        if not self.is_first_stage:
            self.embed = None  # a later pipeline stage held the table only for the tie

    _LAYER_KEYS = (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    )
    _BIAS_KEYS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
    _O_BIAS_KEYS = ("self_attn.o_proj.bias",)
    _MLP_BIAS_KEYS = ("mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias")

    def _layer_keys(self) -> tuple[str, ...]:
        """The tensors of one layer this config runs."""
        a = self.arch
        keys = self._LAYER_KEYS + (self._BIAS_KEYS if a.attention_bias else ())
        keys += self._O_BIAS_KEYS if a.o_proj_bias else ()
        return keys + (self._MLP_BIAS_KEYS if a.mlp_bias else ())

    def _missing_layer_weights(self, pending: dict[int, dict], done: set[int]) -> list[str]:
        """What each of this stage's unfinished layers lacks, a layer with no tensor at all as
        `model.layers.N.*`: a checkpoint short of layers (a shard missing from a directory
        without an index, a config with more layers) ran them on uninitialized memory."""
        out = []
        for idx in range(len(self.layers)):
            if idx in done:
                continue
            name, have = f"model.layers.{idx + self.start_layer}", pending.get(idx, {})
            lacks = [f"{name}.{k}" for k in self._layer_keys() if k not in have]
            out.append(", ".join(lacks) if have else f"{name}.*")
        return out

    def _maybe_finish_layer(self, idx: int, pending: dict[int, dict[str, torch.Tensor]]) -> bool:
        """Load layer `idx` once all its tensors are pending; whether it did."""
        p = pending[idx]
        a = self.arch
        keys = self._layer_keys()
        if not all(k in p for k in keys):
            return False
        unused = sorted(set(p) - set(keys))
        if unused:  # e.g. biases the config does not declare: dropped silently, they would change logits
            where = f"model.layers.{idx + self.start_layer}"
            raise ValueError(f"{where}: tensors this model's config does not use: {unused}")
        layer: DecoderLayer = self.layers[idx]
        method, dev = self.quantization, self.quant_device
        qkv = [p["self_attn.q_proj.weight"], p["self_attn.k_proj.weight"], p["self_attn.v_proj.weight"]]
        biases = None
        if a.attention_bias:
            biases = [p["self_attn.q_proj.bias"], p["self_attn.k_proj.bias"], p["self_attn.v_proj.bias"]]
        layer.qkv_proj.load(qkv, method, dev, biases)
        layer.o_proj.load(p["self_attn.o_proj.weight"], method, dev, p.get("self_attn.o_proj.bias"))
        gate_up = [p["mlp.gate_proj.weight"], p["mlp.up_proj.weight"]]
        mlp_biases = [p["mlp.gate_proj.bias"], p["mlp.up_proj.bias"]] if a.mlp_bias else None
        layer.gate_up_proj.load(gate_up, method, dev, mlp_biases)
        layer.down_proj.load(p["mlp.down_proj.weight"], method, dev, p.get("mlp.down_proj.bias"))
        layer.input_norm.data = p["input_layernorm.weight"]
        layer.post_attn_norm.data = p["post_attention_layernorm.weight"]
        del pending[idx]
        return True
