"""A model's generation_config.json sampling values are the defaults, as vLLM's
`--generation-config auto`: offline (`LLM.get_default_sampling_params`, `generate` without
params) and in the server (a request field left unset). They were ignored."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from server_utils import ServerProcess

from kvserve import LLM, SamplingParams
from kvserve.generation_defaults import capped_max_tokens

# top_k 1: the default sampling is the argmax after the repetition penalty, whatever the seed
RECOMMENDED = {"temperature": 0.6, "top_p": 0.9, "top_k": 1, "repetition_penalty": 1.3, "max_new_tokens": 5}
PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gen") / "model"
    shutil.copytree(tiny_llama_dir, path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, **RECOMMENDED, "do_sample": True}))
    return str(path)


def _greedy_penalized(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=max_tokens)


def test_offline_defaults_are_the_models(model_dir):
    llm = LLM(model_dir, kv_cache_memory="4MiB", max_model_len=256)
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty, d.max_tokens) == (0.6, 0.9, 1, 1.3, 5)
    got = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0].token_ids
    assert got == llm.generate(PROMPT, _greedy_penalized(5), use_tqdm=False)[0].outputs[0].token_ids
    assert LLM(model_dir, kv_cache_memory="4MiB", generation_config="vllm").get_default_sampling_params() == (
        SamplingParams()
    )
    with pytest.raises(ValueError, match="^generation_config: "):
        LLM(model_dir, generation_config=str(model_dir) + "-nowhere")


def test_server_defaults_are_the_models(model_dir, tmp_path):
    s = ServerProcess(model_dir, "--kv-cache-memory", "4MiB", "--max-model-len", "256",
                      log_path=str(tmp_path / "serve.log"))  # fmt: skip
    try:

        def post(path: str, body: dict) -> dict:
            r = httpx.post(f"{s.url}/v1/{path}", json=body, headers=s.headers, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        messages = [{"role": "user", "content": PROMPT}]
        unset = post("chat/completions", {"messages": messages, "seed": 3})
        greedy = {"temperature": 0, "repetition_penalty": 1.3, "max_tokens": 5}
        explicit = post("chat/completions", {"messages": messages, **greedy})
        assert unset["usage"]["completion_tokens"] == 5
        assert unset["choices"][0]["message"] == explicit["choices"][0]["message"]
        # the model's own max_new_tokens is a default only (vLLM's auto): a larger max_tokens holds
        longer = post("completions", {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True})
        assert longer["usage"]["completion_tokens"] == 8
        response = post("responses", {"input": PROMPT, "max_output_tokens": 3})
        assert (response["temperature"], response["top_p"]) == (0.6, 0.9)
        # beam search takes none of them: the default repetition_penalty does not refuse it
        beams = post("completions", {"prompt": PROMPT, "n": 2, "use_beam_search": True, "max_tokens": 3})
        assert len(beams["choices"]) == 2
    finally:
        s.stop()


def test_a_generation_config_directory_caps_max_tokens():
    """vLLM's server: a --generation-config directory's max_new_tokens caps an explicit larger
    max_tokens too (the operator's limit; it was only a default); auto's, the model's own file,
    only fills an unset one, and vllm has none."""
    defaults = {"max_tokens": 5}  # generation_defaults' names: max_new_tokens as max_tokens
    assert capped_max_tokens(8, defaults, "/etc/kvserve/gen") == 5
    assert capped_max_tokens(3, defaults, "/etc/kvserve/gen") == 3
    assert capped_max_tokens(None, defaults, "/etc/kvserve/gen") is None  # the default fills it later
    assert capped_max_tokens(8, defaults, "auto") == 8
    assert capped_max_tokens(8, {}, "/etc/kvserve/gen") == 8
