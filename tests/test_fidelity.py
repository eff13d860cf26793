"""Greedy output and prompt logprobs equal Hugging Face transformers on the same weights,
and batching (alone, together, tiny prefill chunks, forced preemption) never changes them."""

from __future__ import annotations

import pytest
import torch
from conftest import load_reference
from helpers import assert_greedy_match, reference_greedy, reference_logits

from kvserve import LLM, SamplingParams
from kvserve.model.layers.cpu_kernels import load_cpu_kernels

GREEDY = SamplingParams(temperature=0, max_tokens=24)


def _prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    text = (
        "In a quiet village by the sea, the fishermen rose before dawn to mend their nets and "
        "talk about the weather, the prices at the market and the stories of old sailors. "
    ) * 20
    ids = tokenizer.encode(text, add_special_tokens=False)
    # Different starting offsets so prompts are not prefixes of each other.
    return [ids[i : i + n] for i, n in enumerate(lengths)]


def _check_against_reference(llm: LLM, ref, prompts: list[list[int]], params: SamplingParams) -> None:
    eos = sorted(llm.llm_engine.eos_token_ids)
    outs = llm.generate(prompts, params, use_tqdm=False)
    exact = 0
    for i, (p, out) in enumerate(zip(prompts, outs)):
        expected = reference_greedy(ref, p, params.max_tokens, eos)
        exact += assert_greedy_match(ref, p, expected, out.outputs[0].token_ids, f"prompt {i} (len {len(p)})")
    assert exact >= len(prompts) - 1, "more than one near-tie: suspicious"


def _check_prompt_logprobs(llm: LLM, ref, prompt: list[int]) -> None:
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20), use_tqdm=False
    )[0]
    ref_lp = reference_logits(ref, prompt).log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    worst = 0.0
    for j in range(1, len(prompt)):
        entry = out.prompt_logprobs[j]
        assert prompt[j] in entry and len(entry) >= 20
        for tok, lp in entry.items():
            worst = max(worst, abs(lp - ref_lp[j - 1, tok].item()))
    assert worst < 1e-3, f"prompt logprobs differ from the reference by {worst:.2e}"


def _check_batching_invariance(make_llm, ref, prompts: list[list[int]]) -> None:
    """Alone, all together, tiny chunks, and a pool so small that preemption must happen."""
    base = make_llm()
    alone = [base.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in base.generate(prompts, GREEDY, use_tqdm=False)]
    for i, p in enumerate(prompts):
        assert_greedy_match(ref, p, alone[i], together[i], f"together vs alone, prompt {i}")
    base_engine = base.llm_engine
    assert base_engine.kv_cache_manager.num_free_blocks == base_engine.kv_cache_manager.num_blocks

    chunked = make_llm(max_num_batched_tokens=7)
    outs = chunked.generate(prompts, GREEDY, use_tqdm=False)
    for i, p in enumerate(prompts):
        assert_greedy_match(ref, p, alone[i], outs[i].outputs[0].token_ids, f"chunk=7 vs alone, prompt {i}")

    longest = max(len(p) for p in prompts) + GREEDY.max_tokens
    blocks = -(-longest // 16) + 2  # enough for the longest request, far too few for all
    small = make_llm(num_blocks=blocks)
    outs = small.generate(prompts, GREEDY, use_tqdm=False)
    engine = small.llm_engine
    print(f"preemptions: {engine.scheduler.num_preemptions_total}")
    assert engine.scheduler.num_preemptions_total > 0
    for i, p in enumerate(prompts):
        assert_greedy_match(ref, p, alone[i], outs[i].outputs[0].token_ids, f"preempted vs alone, prompt {i}")
    for llm in (chunked, small):
        kv = llm.llm_engine.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks, "KV blocks leaked"


def _factory(model: str, dtype: str = "float32"):
    """Builds engines on `model`; num_blocks sizes the pool in whole blocks."""

    def make(num_blocks: int | None = None, **kw) -> LLM:
        mem = "64MiB"
        if num_blocks is not None:
            probe = LLM(model, dtype=dtype, kv_cache_memory="1MiB")
            mem = num_blocks * probe.llm_engine.pool_size.block_bytes
        return LLM(model, dtype=dtype, kv_cache_memory=mem, **kw)

    return make


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_models_match_transformers(kind, tiny_llama_dir, tiny_qwen2_dir):
    path = tiny_llama_dir if kind == "llama" else tiny_qwen2_dir
    ref = load_reference(path)
    make = _factory(path)
    llm = make()
    prompts = _prompts(llm.tokenizer, [1, 3, 9, 16, 17, 33, 70, 150])
    _check_against_reference(llm, ref, prompts, SamplingParams(temperature=0, max_tokens=40))
    _check_prompt_logprobs(llm, ref, prompts[-1])
    _check_batching_invariance(make, ref, prompts)


def test_tiny_model_logits_match(tiny_llama_dir):
    """Raw logits for a whole prompt, through the paged path, equal the reference's."""
    from kvserve.model.layers.attention import AttentionMetadata, PrefillChunk

    ref = load_reference(tiny_llama_dir)
    llm = LLM(tiny_llama_dir, kv_cache_memory="1MiB")
    runner = llm.llm_engine.model_runner
    prompt = list(range(3, 60))
    n = len(prompt)
    bs = runner.block_size
    meta = AttentionMetadata(torch.arange(n) // bs, torch.arange(n) % bs, prefills=[PrefillChunk(0, n, 0)])
    hidden = runner.model(torch.tensor(prompt), torch.arange(n), meta, runner.kv_cache)
    ours = runner.model.compute_logits(hidden)
    diff = (ours - reference_logits(ref, prompt)).abs().max().item()
    assert diff < 1e-3, diff


@pytest.mark.slow
def test_default_model_matches_transformers(default_llm, default_reference):
    prompts = _prompts(default_llm.tokenizer, [1, 4, 11, 17, 32, 64, 130, 257])
    _check_against_reference(default_llm, default_reference, prompts, GREEDY)
    _check_prompt_logprobs(default_llm, default_reference, prompts[6])


@pytest.mark.slow
def test_default_model_batching_invariance(default_llm, default_reference):
    prompts = _prompts(default_llm.tokenizer, [5, 23, 48, 90, 120, 200])
    made = iter([default_llm])

    def make(num_blocks: int | None = None, **kw) -> LLM:
        if not kw and num_blocks is None:
            return next(made)
        mem = num_blocks * default_llm.llm_engine.pool_size.block_bytes if num_blocks else "64MiB"
        return LLM("smollm2-135m", kv_cache_memory=mem, **kw)

    _check_batching_invariance(make, default_reference, prompts)


def _greedy_bits(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    return [(c.token_ids, [lp[t] for lp, t in zip(c.logprobs, c.token_ids)]) for c in outs]


@pytest.fixture(scope="module")
def tiny_wide_mlp_dir(tmp_path_factory) -> str:
    """The tiny Llama with a 1536-wide MLP: a down projection long enough (K >= ~1536) that
    oneDNN's float32 kernel for one row sums in another order than for several."""
    from conftest import _save_tiny

    return _save_tiny(str(tmp_path_factory.mktemp("tiny-wide-mlp")), "llama", intermediate_size=1536)


@pytest.fixture(scope="module")
def tiny_wide_bf16_dir(tmp_path_factory) -> str:
    """A 512-wide Llama with an 8,192-token head: shapes where bf16 rounding shows (a 64-wide one
    gave the same bf16 bits either way)."""
    from conftest import _save_tiny

    return _save_tiny(str(tmp_path_factory.mktemp("tiny-wide-bf16")), "llama", hidden_size=512,
                      intermediate_size=1024, num_attention_heads=8, vocab_size=8192)  # fmt: skip


@pytest.mark.skipif(load_cpu_kernels() is None, reason="C++ kernels not built here")
@pytest.mark.parametrize(
    ("model", "engine"),
    [
        ("tiny_llama_dir", {"kv_cache_dtype": "fp8_e4m3"}),
        ("tiny_wide_mlp_dir", {"kv_cache_dtype": "fp8_e4m3"}),
        ("tiny_wide_bf16_dir", {"dtype": "bfloat16"}),
    ],
)
def test_float_model_with_a_coarse_cache_gives_the_same_bits_in_any_batch(request, model, engine):
    """float32 weights and an fp8 KV cache, or bf16 weights and cache: each prompt alone, then all
    together (their cached blocks hit), then in 7-token chunks in a pool so small requests are
    preempted: the same tokens and logprobs to the bit. A prompt's attention over a fresh SDPA chunk
    and over one after cached blocks differed in the last bits (now prompt rows go as decode rows,
    ModelRunner._stack_takes_chunks), and fp8 codes at a rounding edge turn such bits into steps of
    up to 1/16 of a vector's range: on the default model logprobs moved by up to 0.27, and greedy
    text changed at a top-2 gap of 0.02. With a 1536-wide MLP a lone decode row's down projection
    differed too (oneDNN's one-row kernel): now one row runs as two (worker/shape_buckets.py). bf16
    weights with their bf16 cache: SDPA's output rounded to bf16 after a chunk's cached blocks moved
    logprobs by up to 0.10 against one fresh chunk."""
    path = request.getfixturevalue(model)
    llm = LLM(path, kv_cache_memory="16MiB", **engine)
    assert llm.llm_engine.model_runner.attn_backend.prompt_rows_as_decodes
    prompts = _prompts(llm.tokenizer, [3, 17, 33, 70])
    alone = [_greedy_bits(llm, [p])[0] for p in prompts]
    assert _greedy_bits(llm, prompts) == alone
    block_bytes = llm.llm_engine.pool_size.block_bytes
    small = LLM(path, kv_cache_memory=7 * block_bytes, max_num_batched_tokens=7, **engine)
    assert _greedy_bits(small, prompts) == alone
    assert small.llm_engine.scheduler.num_preemptions_total > 0
    for e in (llm.llm_engine, small.llm_engine):
        assert e.kv_cache_manager.num_free_blocks == e.kv_cache_manager.num_blocks


def test_llama_biases_everywhere_match_transformers(tmp_path):
    """Llama's attention_bias biases q, k, v and o_proj; mlp_bias gate, up and down. Once only
    q/k/v were loaded and the rest dropped without a word (1.5-2.2 nats off); a checkpoint
    whose config does not declare the biases it holds is refused rather than half-loaded."""
    import json

    from conftest import _tiny_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                      attention_bias=True, mlp_bias=True)  # fmt: skip
    ref = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)  # HF starts biases at zero, which would hide a dropped one
    ref.save_pretrained(tmp_path)
    _tiny_tokenizer().save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), kv_cache_memory="4MiB")
    prompt = list(range(3, 40))
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False
    )
    ref_lp = reference_logits(ref, prompt).log_softmax(-1)
    worst = max(
        abs(out[0].prompt_logprobs[j][prompt[j]] - ref_lp[j - 1, prompt[j]].item()) for j in range(1, 37)
    )
    assert worst < 1e-3, worst
    _check_against_reference(llm, ref, [prompt, prompt[5:20]], SamplingParams(temperature=0, max_tokens=12))
    llm.llm_engine.core.shutdown()

    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "mlp_bias": False}))
    with pytest.raises(
        ValueError, match=r"model\.layers\.0: tensors this model's config does not use: .*mlp"
    ):
        LLM(str(tmp_path), kv_cache_memory="4MiB")


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_an_attention_bias_key_transformers_does_not_read_changes_nothing(kind, tmp_path):
    """transformers builds Qwen2's q, k, v with biases and Mistral's without, whatever the
    config's attention_bias says (only Llama reads it). kvserve read it for all three: a Qwen2
    whose config carries attention_bias false was refused over its own biases, and a Mistral
    with attention_bias true waited for biases its checkpoint never held."""
    import json

    from conftest import _save_tiny, _tiny_tokenizer
    from transformers import MistralConfig, MistralForCausalLM

    if kind == "qwen2":
        path = _save_tiny(str(tmp_path / kind), kind, random_biases=True)
    else:
        torch.manual_seed(0)
        cfg = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                            sliding_window=None)  # fmt: skip
        MistralForCausalLM(cfg).save_pretrained(tmp_path / kind)
        _tiny_tokenizer().save_pretrained(tmp_path / kind)
        path = str(tmp_path / kind)
    cfg_path = tmp_path / kind / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "attention_bias": kind == "mistral"}))
    ref = load_reference(path)
    llm = LLM(path, kv_cache_memory="4MiB")
    prompt = list(range(3, 40))
    _check_against_reference(
        llm, ref, [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    _check_prompt_logprobs(llm, ref, prompt)
    llm.llm_engine.core.shutdown()


def test_a_checkpoint_short_of_layers_is_refused(tmp_path):
    """A layer none of whose tensors arrived was never checked: a config with more layers
    than its checkpoint, or a sharded directory without its index that lacks a shard, loaded
    and ran those layers on uninitialized memory (and a partial layer was reported by the
    tensors it had rather than those it lacked)."""
    import json
    import os

    from conftest import _save_tiny, _tiny_tokenizer
    from transformers import AutoModelForCausalLM

    path = _save_tiny(str(tmp_path / "two"), "llama")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(path).save_pretrained(sharded, max_shard_size="40KB")
    _tiny_tokenizer().save_pretrained(sharded)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    os.remove(sharded / "model.safetensors.index.json")
    os.remove(sharded / index["model.layers.1.mlp.down_proj.weight"])
    with pytest.raises(ValueError, match=r"^missing weights: .*model\.layers\.1\.mlp\.down_proj\.weight"):
        LLM(str(sharded), kv_cache_memory="1MiB")

    cfg_path = tmp_path / "two" / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"^missing weights: model\.layers\.2\.\*$"):
        LLM(path, kv_cache_memory="1MiB")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("intermediate_size", 96, "model.layers.0.mlp.down_proj.weight: shape [64, 128] where the config "
                                  "gives [64, 96] (hidden_size, intermediate_size)"),
        ("hidden_size", 48, "lm_head.weight: shape [512, 64] where the config gives [512, 48] "
                            "(vocab_size, hidden_size)"),
    ],
    ids=["intermediate_size", "hidden_size"],
)  # fmt: skip
def test_a_config_that_disagrees_with_its_checkpoint_is_refused_naming_the_tensor(
    field, value, message, tiny_llama_dir, tmp_path
):
    """transformers refuses a tensor of another shape than its config's, by name. kvserve said
    "weight shard: 128 rows, expected 96 or 96", naming nothing; a hidden_size the loader
    does not slice along (head_dim set) was not checked at all: the checkpoint's own shapes
    loaded and ran under a config describing another model."""
    import json
    import re
    import shutil

    path = tmp_path / "edited"
    shutil.copytree(tiny_llama_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        LLM(str(path), kv_cache_memory="1MiB")


def test_dynamic_rope_scaling_matches_transformers_up_to_the_context(tmp_path):
    """transformers' dynamic NTK rope keeps the default frequencies until a sequence outgrows
    max_position_embeddings, which is where kvserve's context stops: it runs such a model
    exactly (it was refused as an unsupported rope_type). Here to the last position."""
    from conftest import _save_tiny

    rope = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    path = _save_tiny(str(tmp_path / "dynamic"), "qwen2", random_biases=True, max_position_embeddings=64,
                      rope_parameters=rope)  # fmt: skip
    ref = load_reference(path)
    llm = LLM(path, kv_cache_memory="4MiB")
    assert llm.llm_engine.max_model_len == 64
    prompts = [list(range(3, 53)), [5, 9, 30]]
    _check_against_reference(llm, ref, prompts, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    _check_prompt_logprobs(llm, ref, prompts[0])
    llm.llm_engine.core.shutdown()


@pytest.mark.parametrize(
    "rope",
    [
        {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },  # Qwen2.5's long-context form
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 16,
            "beta_slow": 2,
            "mscale": 0.7,
            "mscale_all_dim": 1.0,
        },  # fmt: skip
    ],
)
def test_yarn_rope_scaling_matches_transformers(rope, tmp_path):
    """YaRN (static, as transformers runs it): it was refused. The rotary tables equal
    transformers' to the bit, and greedy tokens too, past max_position_embeddings up to the
    context it scales to (original_max_position_embeddings x factor, as vLLM serves it)."""
    import json

    from conftest import _save_tiny

    path = _save_tiny(str(tmp_path / "yarn"), "qwen2", random_biases=True, max_position_embeddings=64)
    cfg_path = tmp_path / "yarn" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("rope_parameters", None)
    cfg_path.write_text(json.dumps({**cfg, "rope_theta": 10000.0, "rope_scaling": rope}))
    ref = load_reference(path)
    llm = LLM(path, kv_cache_memory="4MiB")
    scaled = int(rope["original_max_position_embeddings"] * rope["factor"])
    assert llm.llm_engine.max_model_len == max(64, scaled)
    rotary = llm.llm_engine.model_runner.model.rotary
    positions = torch.arange(rotary.cos.shape[0])[None]
    cos, sin = ref.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    assert torch.equal(rotary.cos, cos[0]) and torch.equal(rotary.sin, sin[0])
    prompts = [list(range(3, 103)), [5, 9, 30]]
    _check_against_reference(llm, ref, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    _check_prompt_logprobs(llm, ref, prompts[0])
    llm.llm_engine.core.shutdown()


@pytest.mark.parametrize(
    ("top_level", "in_rope"),
    [(None, None), (32, 64)],
    ids=["defaults-to-max-positions", "top-level-wins"],
)
def test_llama3_rope_reads_its_original_length_as_transformers_does(top_level, in_rope, tmp_path):
    """transformers' standardize_rope_params gives llama3 scaling an original length: a
    top-level original_max_position_embeddings over the rope dict's, or max_position_embeddings
    where neither names one. kvserve took only the rope dict's: without it a bare KeyError at
    load; with a top-level one, other frequencies (prompt logprobs 3.6 nats off)."""
    import json

    from conftest import _save_tiny

    path = _save_tiny(str(tmp_path / "llama3"), "llama", max_position_embeddings=256)
    cfg_path = tmp_path / "llama3" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rope = {k: v for k, v in cfg["rope_parameters"].items() if k != "original_max_position_embeddings"}
    cfg["rope_parameters"] = (
        rope if in_rope is None else {**rope, "original_max_position_embeddings": in_rope}
    )
    if top_level is not None:
        cfg["original_max_position_embeddings"] = top_level
    cfg_path.write_text(json.dumps(cfg))
    ref = load_reference(path)
    llm = LLM(path, kv_cache_memory="4MiB")
    prompt = list(range(3, 200))
    _check_against_reference(llm, ref, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    _check_prompt_logprobs(llm, ref, prompt)
    llm.llm_engine.core.shutdown()


def test_sliding_window_caps_the_context(tmp_path):
    """A Mistral whose layers slide over 16 positions: kvserve attends to every position, the
    model's attention only while a sequence fits the window, so the context stops there (it
    was the full 512, and greedy output left transformers' past position 16)."""
    from conftest import _tiny_tokenizer
    from transformers import MistralConfig, MistralForCausalLM

    from kvserve.model.arch import ModelArch

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        initializer_range=0.2, bos_token_id=1, eos_token_id=2, sliding_window=16)  # fmt: skip
    ref = MistralForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path)
    _tiny_tokenizer().save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), kv_cache_memory="4MiB")
    assert llm.llm_engine.max_model_len == 16
    _check_against_reference(llm, ref, [list(range(3, 13))], SamplingParams(temperature=0, max_tokens=6))
    with pytest.raises(ValueError, match="prompt: this model's maximum context length is 16"):
        llm.generate([list(range(3, 30))], GREEDY, use_tqdm=False)
    llm.llm_engine.core.shutdown()
    with pytest.raises(ValueError, match="max_model_len: 32 exceeds the model's sliding attention window 16"):
        LLM(str(tmp_path), kv_cache_memory="4MiB", max_model_len=32)

    # Which configs slide, as transformers reads them.
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=2)  # fmt: skip
    cases = [
        (dict(model_type="mistral", sliding_window=None), None),
        (dict(model_type="qwen2", sliding_window=32, use_sliding_window=False), None),
        (dict(model_type="qwen2", sliding_window=32, use_sliding_window=True, max_window_layers=2), 32),
        (dict(model_type="qwen2", sliding_window=32, use_sliding_window=True, max_window_layers=4), None),
        (dict(model_type="qwen2", sliding_window=32, layer_types=["full_attention"] * 4), None),
        (dict(model_type="llama", sliding_window=32), None),
        # Mistral reads no layer_types, and its window is 4096 where the file names none.
        (dict(model_type="mistral", sliding_window=32, layer_types=["full_attention"] * 4), 32),
        (dict(model_type="mistral"), 4096),
        # Qwen2 slides only under use_sliding_window, from layer 28 by default, at 4096 by default.
        (dict(model_type="qwen2", sliding_window=32, layer_types=["sliding_attention"] * 4), None),
        (dict(model_type="qwen2", sliding_window=32, use_sliding_window=True), None),
        (dict(model_type="qwen2", use_sliding_window=True, max_window_layers=2), 4096),
    ]
    for extra, window in cases:
        assert ModelArch.from_hf_config({**base, **extra}).sliding_window == window, extra


def test_a_qwen2_listing_sliding_layers_without_use_sliding_window_attends_to_all(tmp_path):
    """A Qwen2 config with use_sliding_window false whose layer_types list sliding layers (and
    sliding_window is set): transformers' attention sets the window to None and attends to every
    position. kvserve capped the context at the window (16 of 512 tokens here), refusing the
    prompts the model runs. The reference is the same weights with every layer full."""
    import json

    from conftest import _save_tiny

    path = _save_tiny(str(tmp_path / "qwen2"), "qwen2", random_biases=True)
    ref = load_reference(path)
    cfg_path = tmp_path / "qwen2" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(use_sliding_window=False, sliding_window=16, max_window_layers=0,
               layer_types=["sliding_attention"] * cfg["num_hidden_layers"])  # fmt: skip
    cfg_path.write_text(json.dumps(cfg))
    llm = LLM(path, kv_cache_memory="4MiB")
    assert llm.llm_engine.max_model_len == 512
    prompt = list(range(3, 60))
    _check_against_reference(
        llm, ref, [prompt, [7, 8]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    llm.llm_engine.core.shutdown()


def test_an_activation_or_a_prequantized_checkpoint_is_refused(tmp_path):
    """The MLP is silu(gate) * up: a config naming another hidden_act loaded and ran it as
    SiLU, other tokens than transformers' with no word; now it is refused by name."""
    import json
    import shutil

    from conftest import _save_tiny

    from kvserve.model.arch import ModelArch

    path = _save_tiny(str(tmp_path / "gelu"), "llama")
    cfg_path = tmp_path / "gelu" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["hidden_act"] = "gelu"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'"):
        LLM(path, kv_cache_memory="1MiB")
    # A GPTQ / AWQ / fp8 directory: its qweight / scales tensors were refused one layer at a
    # time by name ("incomplete layer weights"), never saying why.
    cfg["hidden_act"] = "silu"
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"unsupported pre-quantized checkpoint \(quantization_config: awq\)"
    ):
        LLM(path, kv_cache_memory="1MiB")
    shutil.rmtree(path)
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    for act in ("silu", "swish", None):
        extra = {} if act is None else {"hidden_act": act}
        assert ModelArch.from_hf_config({**base, **extra}).hidden_size == 8


@pytest.mark.parametrize("sharded", [True, False])
def test_a_mistral_repository_with_consolidated_weights_loads(tmp_path, sharded):
    """Mistral's repositories hold consolidated.safetensors (mistral-inference's names) beside
    transformers' files; every *.safetensors was read, and the model was refused on
    'unexpected weight'. transformers' own files are read (the index's, or model.safetensors),
    and the tokens are transformers'."""
    from conftest import _tiny_tokenizer
    from safetensors.torch import save_file
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                        sliding_window=None)  # fmt: skip
    ref = MistralForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path, max_shard_size="100KB" if sharded else "1GB")
    _tiny_tokenizer().save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded
    embed = ref.model.embed_tokens.weight.detach().clone()
    save_file({"tok_embeddings.weight": embed}, str(tmp_path / "consolidated.safetensors"))
    llm = LLM(str(tmp_path), kv_cache_memory="2MiB")
    greedy = SamplingParams(temperature=0, max_tokens=12)
    _check_against_reference(llm, ref, [list(range(3, 20)), [7]], greedy)


def test_a_tied_config_over_a_checkpoint_with_its_own_head_runs_that_head(tmp_path):
    """config.json says tie_word_embeddings but the checkpoint also holds an lm_head.weight
    of its own: transformers (5.x) then unties them and runs the checkpoint's head. kvserve ran
    the embedding as the head, other tokens from the first one (5 nats off). A head equal to
    the table (a .bin export stores the shared tensor twice) stays tied, one copy held."""
    import json

    from conftest import _save_tiny
    from safetensors.torch import load_file, save_file

    path = _save_tiny(str(tmp_path / "own-head"), "llama")  # untied: its own random lm_head
    cfg_path = tmp_path / "own-head" / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "tie_word_embeddings": True}))
    ref = load_reference(path)
    assert not torch.equal(ref.lm_head.weight, ref.model.embed_tokens.weight)  # the reference's reading
    llm = LLM(path, kv_cache_memory="4MiB")
    prompt = list(range(3, 40))
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    _check_against_reference(llm, ref, [prompt, [5, 9, 30]], greedy)
    _check_prompt_logprobs(llm, ref, prompt)
    assert not llm.llm_engine.model_runner.model.lm_head.tied
    llm.llm_engine.core.shutdown()

    weights_path = str(tmp_path / "own-head" / "model.safetensors")
    state = load_file(weights_path)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, weights_path, metadata={"format": "pt"})
    ref = load_reference(path)
    llm = LLM(path, kv_cache_memory="4MiB")
    _check_against_reference(llm, ref, [prompt], greedy)
    assert llm.llm_engine.model_runner.model.lm_head.tied
    llm.llm_engine.core.shutdown()


def test_a_sharded_directory_saved_over_as_one_file_loads_that_file(tmp_path):
    """save_pretrained as one file over a sharded directory deletes the shards but leaves
    model.safetensors.index.json; transformers reads model.safetensors first. kvserve read the
    index first and refused the directory over the shards it named."""
    from conftest import _tiny_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.2, bos_token_id=1, eos_token_id=2)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path, max_shard_size="100KB")
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)  # other weights, one file
    _tiny_tokenizer().save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()  # stale: its shards are gone
    ref = load_reference(str(tmp_path))
    llm = LLM(str(tmp_path), kv_cache_memory="2MiB")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    _check_against_reference(llm, ref, [list(range(3, 30)), [7]], greedy)
    llm.llm_engine.core.shutdown()
