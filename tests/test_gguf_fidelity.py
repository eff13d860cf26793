"""A GGUF file runs the model it was converted from: greedy tokens and logits equal
transformers' on the same weights, for each architecture's row layout in llama.cpp's files."""

from __future__ import annotations

import re

import pytest
from conftest import _save_tiny, load_reference
from helpers import assert_greedy_match, reference_greedy, reference_logits
from tiny_gguf import write_gguf

from kvserve import LLM, SamplingParams

PROMPTS = [[5, 9, 30, 41, 100, 7, 8, 9, 10, 11, 12], list(range(20, 60)), [3]]


@pytest.mark.parametrize("kind", ["qwen2", "llama", "llama-biased"])
def test_a_converted_gguf_gives_the_directory_s_tokens(kind, tmp_path):
    """The reference is the directory itself. qwen2: llama.cpp keeps Hugging Face's Q / K
    rows (NEOX rotary), and they were un-permuted as a llama file's are, so every Qwen2 GGUF
    ran scrambled attention. llama: the tiny Llama has llama3 rope scaling, which its file
    holds as the rope_freqs tensor (as Llama 3.1 / 3.2 GGUFs do); it was skipped, so every
    position rotated unscaled (transformers' GGUF reader skips it too). llama-biased: a Llama
    with attention_bias and mlp_bias, whose file holds attn_output and ffn biases (llama.cpp
    adds them); refused as tensors the model did not use."""
    extra = {"attention_bias": True, "mlp_bias": True} if kind == "llama-biased" else {}
    kind = kind.split("-")[0]
    hf_dir = _save_tiny(str(tmp_path / kind), kind, random_biases=True, **extra)
    path = write_gguf(hf_dir, str(tmp_path / f"{kind}.gguf"))
    _check_gguf_against(hf_dir, path, kind)


def _check_gguf_against(hf_dir: str, path: str, kind: str) -> None:
    """Greedy tokens and prompt logprobs of the GGUF at `path` equal transformers' on `hf_dir`."""
    ref = load_reference(hf_dir)
    llm = LLM(path, kv_cache_memory="4MiB")
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    for i, (p, out) in enumerate(zip(PROMPTS, outs)):
        expected = reference_greedy(ref, p, 20, None)
        assert_greedy_match(ref, p, expected, list(out.outputs[0].token_ids), f"{kind} gguf, prompt {i}")
    got = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    ref_lp = reference_logits(ref, PROMPTS[1]).log_softmax(-1)
    worst = max(
        abs(got.prompt_logprobs[j][PROMPTS[1][j]] - ref_lp[j - 1, PROMPTS[1][j]].item())
        for j in range(1, len(PROMPTS[1]))
    )
    assert worst < 1e-3, f"prompt logprobs differ from the reference by {worst:.2e}"
    llm.llm_engine.core.shutdown()


@pytest.mark.parametrize("form", ["old-scale-linear-key", "linear-without-factor"])
def test_linear_rope_scaling_is_read_as_llama_cpp_reads_it(form, tmp_path):
    """llama.cpp's reading: the scaling type defaults to linear, the factor is
    rope.scaling.factor or the old converters' rope.scale_linear, and none (or 0) is 1.0. A
    file of type linear without a factor crashed the load (a TypeError), and a file with only
    scale_linear (no type key) ran unscaled: other tokens than its own model's."""
    import gguf

    if form == "old-scale-linear-key":
        rope = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
        hf_dir = _save_tiny(str(tmp_path / "hf"), "qwen2", random_biases=True, rope_parameters=rope)

        def more(w) -> None:
            w.add_float32("qwen2.rope.scale_linear", 4.0)
    else:
        hf_dir = _save_tiny(str(tmp_path / "hf"), "qwen2", random_biases=True)

        def more(w) -> None:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)

    path = write_gguf(hf_dir, str(tmp_path / "linear.gguf"), more=more)
    _check_gguf_against(hf_dir, path, form)


def test_rope_scaling_kvserve_does_not_run_is_refused(tiny_qwen2_dir, tmp_path):
    """A file's yarn rope scaling (Qwen2.5's long-context conversions) was ignored: the model
    ran unscaled rotary, other tokens than its own, with no word. Refused as a config's is."""
    import gguf

    def yarn(w) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(128)

    path = write_gguf(tiny_qwen2_dir, str(tmp_path / "yarn.gguf"), more=yarn)
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
        LLM(path, kv_cache_memory="1MiB")


def test_a_gguf_llama_cpp_cannot_run_as_written_is_refused_naming_its_key(tiny_llama_dir, tmp_path):
    """Rotary over part of each head (rope.dimension_count under key_length) ran over all of
    it, other tokens than the file's model (llama.cpp refuses a llama file's). A file without
    a key of the model's shape failed with a TypeError (int(None)), or for context_length and
    the RMS norm's epsilon, which llama.cpp requires, ran with a guess (2048, 1e-6)."""

    def partial(w) -> None:
        w.add_key_length(16)
        w.add_value_length(16)
        w.add_rope_dimension_count(8)  # over write_gguf's 16

    path = write_gguf(tiny_llama_dir, str(tmp_path / "partial.gguf"), more=partial)
    with pytest.raises(
        ValueError, match=r"rotary over 8 of each head's 16 dimensions \(llama\.rope\.dimension_count\)"
    ):
        LLM(path, kv_cache_memory="1MiB")

    for key in ("context_length", "attention.layer_norm_rms_epsilon", "feed_forward_length", "block_count"):

        def drop(w, key=key) -> None:
            del w.kv_data[0][f"llama.{key}"]

        path = write_gguf(tiny_llama_dir, str(tmp_path / f"no-{key}.gguf"), more=drop)
        with pytest.raises(ValueError, match=rf"^model: GGUF without llama\.{re.escape(key)}$"):
            LLM(path, kv_cache_memory="1MiB")


def test_a_gguf_with_tensors_kvserve_does_not_run_is_refused(tiny_llama_dir, tmp_path):
    """Per-layer tensors of a kind the loader did not know (a Mixtral file's router and experts,
    a q/k norm) were skipped without a word, and the model ran without them; llama.cpp refuses
    a file with tensors its graph does not use. Now refused at load, by name; a llama file
    with experts by its expert_count."""
    import numpy as np

    def q_norm(w) -> None:
        w.add_tensor("blk.0.attn_q_norm.weight", np.ones(16, dtype=np.float32))

    path = write_gguf(tiny_llama_dir, str(tmp_path / "qnorm.gguf"), more=q_norm)
    with pytest.raises(ValueError, match=r"GGUF tensors kvserve does not run: blk\.0\.attn_q_norm\.weight$"):
        LLM(path, kv_cache_memory="1MiB")

    def experts(w) -> None:
        w.add_expert_count(4)
        w.add_expert_used_count(2)

    path = write_gguf(tiny_llama_dir, str(tmp_path / "moe.gguf"), more=experts)
    with pytest.raises(ValueError, match=r"mixture-of-experts GGUF \(llama\.expert_count = 4\)"):
        LLM(path, kv_cache_memory="1MiB")

    # A block past block_count was skipped by the loader: the model ran truncated to the
    # count's layers, where llama.cpp refuses the file's extra tensors.
    path = write_gguf(tiny_llama_dir, str(tmp_path / "short.gguf"), more=lambda w: w.add_block_count(1))
    with pytest.raises(ValueError, match=r"does not run: blk\.1\.attn_k\.weight, .* and 4 more$"):
        LLM(path, kv_cache_memory="1MiB")


@pytest.mark.parametrize(
    ("pre", "add_bos", "bos_first"),
    [
        ("llama-bpe", None, True),
        ("tekken", None, True),
        ("default", None, False),
        ("llama-bpe", False, False),
    ],
)
def test_a_gguf_prompt_begins_with_bos_as_llama_cpp_s(pre, add_bos, bos_first, tiny_llama_dir, tmp_path):
    """Where a file has no tokenizer.ggml.add_bos_token, llama.cpp adds a BOS after a Llama 3
    family pre-tokenizer (llama-bpe: Llama 3's first conversions wrote no key); kvserve added
    one only for a sentencepiece vocabulary, so such a Llama 3 file was prompted without its
    <|begin_of_text|>. The key, where present, decides."""
    from kvserve.model.loader import load_tokenizer, resolve_model

    path = write_gguf(tiny_llama_dir, str(tmp_path / "bos.gguf"), pre=pre, add_bos=add_bos)
    tok = load_tokenizer(resolve_model(path))
    ids = tok.encode("Hello world")
    assert (ids[0] == tok.bos_token_id == 1) is bos_first
    assert ids[bos_first:] == tok.encode("Hello world", add_special_tokens=False)


@pytest.mark.parametrize(("add_bos", "add_eos"), [(True, True), (False, True), (True, False)])
def test_a_gguf_s_bos_and_eos_are_added_as_transformers_adds_them(add_bos, add_eos, tiny_llama_dir, tmp_path):
    """tokenizer.ggml.add_eos_token was never read: a file that sets it (embedding models
    whose last token's state is the vector) was prompted without its final EOS, unlike
    transformers' GGUF tokenizer and llama.cpp, which append it to a text prompt. The BOS was
    kvserve's own step after the tokenizer: `LLM.get_tokenizer()` (vLLM scripts tokenize
    with it for prompt_token_ids) added none, and a text already starting with the BOS
    token got no second one (transformers, vLLM and llama.cpp add it)."""
    import os

    from transformers import AutoTokenizer

    from kvserve.model.loader import load_tokenizer, resolve_model

    eos = lambda w: w.add_add_eos_token(add_eos)  # noqa: E731
    path = write_gguf(tiny_llama_dir, str(tmp_path / "eos.gguf"), add_bos=add_bos, more=eos)
    tok = load_tokenizer(resolve_model(path))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path))
    for text in ("Hello world", "", "<s>Hello</s>"):
        assert tok.encode(text) == ref.encode(text) == tok.hf.encode(text), text
        plain = ref.encode(text, add_special_tokens=False)
        assert tok.encode(text, add_special_tokens=False) == plain
        assert tok.hf.encode(text, add_special_tokens=False) == plain
    ids = tok.encode("Hello world")
    assert (ids[0] == tok.bos_token_id == 1) is add_bos and (ids[-1] == tok.eos_token_id == 2) is add_eos
