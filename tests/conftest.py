"""Fixtures: tiny random Llama / Qwen2 models saved as Hugging Face directories, and the
default model shared across tests (loading it once keeps the suite fast)."""

from __future__ import annotations

import functools
import os

import pytest
import torch

CORPUS = (
    "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values "
    "in fixed-size blocks. Continuous batching schedules every step. Hello world! 0123456789 "
    "héllo wörld — naïve café ✓ 日本語 🙂 "
) * 4


@functools.cache
def _tiny_tokenizer():
    """A byte-level BPE tokenizer with a small vocabulary, trained in milliseconds (once, so
    the tiny models share it and can draft for each other)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([CORPUS], trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    return hf


def _save_tiny(path: str, kind: str, num_kv_heads: int = 2, random_biases: bool = False, **shape) -> str:
    """A tiny random model and tokenizer in `path`; `shape` overrides config fields. With
    `random_biases`, every bias is drawn from N(0, 0.5): transformers starts them at zero,
    which would hide a bias that was dropped."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        initializer_range=0.2,  # peaked logits: few near-ties in greedy comparisons
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(shape)
    if kind == "llama":
        cfg = LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            },
        )  # fmt: skip
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen2Config(**common, tie_word_embeddings=True, rope_theta=10000.0)
        model = Qwen2ForCausalLM(cfg)
    if random_biases:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, 0.5)
    model.save_pretrained(path)
    _tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return _save_tiny(str(tmp_path_factory.mktemp("tiny-llama")), "llama")


@pytest.fixture(scope="session")
def tiny_long_dir(tmp_path_factory) -> str:
    """The tiny Llama with an 8k context, for requests that must stream for a long time."""
    import json

    path = _save_tiny(str(tmp_path_factory.mktemp("tiny-8k")), "llama")
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = 8192
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return path


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    return _save_tiny(str(tmp_path_factory.mktemp("tiny-qwen2")), "qwen2")


@pytest.fixture(scope="session")
def tiny_biased_dirs(tmp_path_factory) -> dict[str, str]:
    """Qwen2 (biased q, k, v) and Llama with attention_bias and mlp_bias (every projection
    biased), the biases random rather than transformers' zeros."""

    def save(kind: str, **shape) -> str:
        return _save_tiny(str(tmp_path_factory.mktemp(f"biased-{kind}")), kind, random_biases=True, **shape)

    return {"qwen2": save("qwen2"), "llama": save("llama", attention_bias=True, mlp_bias=True)}


@pytest.fixture(scope="session")
def tiny_llama_kv1_dir(tmp_path_factory) -> str:
    """One KV head for four query heads: tensor parallelism must replicate it."""
    return _save_tiny(str(tmp_path_factory.mktemp("tiny-llama-kv1")), "llama", num_kv_heads=1)


def load_reference(path: str):
    """transformers' own model for a directory or GGUF file, fp32 (the fidelity reference)."""
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        import functools
        from unittest import mock

        import gguf

        d, f = os.path.split(path)
        # transformers parses the file twice (config, then weights) and builds gguf's tensor-name
        # map once per module of the model (397 times for the default model): 10 of the load's 20
        # s. Both are pure functions of their arguments, read and never changed, so each is built
        # once here.
        with (
            mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)),
            mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)),
        ):
            return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_llm():
    from kvserve import LLM

    return LLM("smollm2-135m", kv_cache_memory="512MiB")


@pytest.fixture(scope="session")
def default_reference():
    from kvserve.model.loader.resolve import default_model_file

    return load_reference(default_model_file())


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


COMPAT_ORIGIN = "http://app.example"


@pytest.fixture(scope="session")
def compat_server(tmp_path_factory):
    """One live `kvserve serve` on the default model, with the options issue 23's clients need
    (aliases, a CORS origin, vLLM metric names); test_openai_compat and test_clients share it."""
    from server_utils import ServerProcess

    log = tmp_path_factory.mktemp("compat") / "serve.log"
    s = ServerProcess(
        "smollm2-135m", "--kv-cache-memory", "64MiB", "--max-num-seqs", "8",
        "--served-model-name", "smol", "smol-alias", "--allowed-origins", COMPAT_ORIGIN,
        "--metrics-compat", "vllm", log_path=str(log),
    )  # fmt: skip
    s.log_file = log
    yield s
    s.stop()
