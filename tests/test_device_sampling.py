"""Sampling on the device, wired through the real engine on the CPU: KVSERVE_DEVICE_SAMPLING=1
runs the CUDA path's routing here (the engine lists the rows that need no host state, the runner
samples them where the logits are, only token ids come back). Every test compares against an
engine with it off and checks, by watching what the runner returned, which rows went where."""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict

import jsonschema
import pytest
import torch

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve.distributed.step_channel import decode_output, decode_step, encode_output, encode_step
from kvserve.executor.device_sampling import DEVICE_SAMPLING_ENV, device_sampling_enabled
from kvserve.worker.step_input import DeviceSampling, RunnerOutput, StepInput

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{1,6} [0-9]{2}"
PROMPTS = ["Hello", "The quick brown fox", "A paged KV cache stores keys", "0123456789 " * 6]


def _engine(path: str, on: bool, **kwargs) -> LLM:
    """An engine with device sampling on or off (the switch is read when the engine starts)."""
    old = os.environ.get(DEVICE_SAMPLING_ENV)
    os.environ[DEVICE_SAMPLING_ENV] = "1" if on else "0"
    try:
        # max_num_batched_tokens 32: the longest prompt is prefilled in chunks (no token mid-prompt)
        llm = LLM(path, kv_cache_memory="16MiB", max_model_len=256, max_num_batched_tokens=32, **kwargs)
    finally:
        if old is None:
            del os.environ[DEVICE_SAMPLING_ENV]
        else:
            os.environ[DEVICE_SAMPLING_ENV] = old
    assert (llm.llm_engine.core.executor.device_sampling is not None) == on
    return llm


class Routes:
    """Per request id, how many of its tokens came back sampled on the device / as logits rows."""

    def __init__(self, llm: LLM) -> None:
        self.device: dict[str, int] = defaultdict(int)
        self.host: dict[str, int] = defaultdict(int)
        sampler = llm.llm_engine.core.executor.driver_sampler
        inner = sampler.sample

        def spy(out: RunnerOutput, requests):
            for rid in out.sampled:
                self.device[rid] += 1
            for rid in out.sample_req_ids:
                self.host[rid] += 1
            return inner(out, requests)

        sampler.sample = spy


@pytest.fixture(scope="module")
def host_llm(tiny_llama_dir) -> LLM:
    return _engine(tiny_llama_dir, on=False)


@pytest.fixture(scope="module")
def device_llm(tiny_llama_dir) -> tuple[LLM, Routes]:
    llm = _engine(tiny_llama_dir, on=True)
    return llm, Routes(llm)


def _gen(llm: LLM, prompts: list[str], params: list[SamplingParams]):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _rid(llm: LLM, prompts: list[str], params: list[SamplingParams]):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.request_id, o.outputs[0]) for o in outs]


def test_switch():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    env = os.environ.pop(DEVICE_SAMPLING_ENV, None)
    try:
        assert not device_sampling_enabled(cpu) and device_sampling_enabled(cuda)
        os.environ[DEVICE_SAMPLING_ENV] = "1"
        assert device_sampling_enabled(cpu)
        os.environ[DEVICE_SAMPLING_ENV] = "0"
        assert not device_sampling_enabled(cuda)
        os.environ[DEVICE_SAMPLING_ENV] = "yes"
        with pytest.raises(ValueError, match=DEVICE_SAMPLING_ENV):
            device_sampling_enabled(cpu)
    finally:
        os.environ.pop(DEVICE_SAMPLING_ENV, None)
        if env is not None:
            os.environ[DEVICE_SAMPLING_ENV] = env


def test_greedy_equals_host_and_every_token_is_sampled_on_device(host_llm, device_llm):
    llm, routes = device_llm
    params = [SamplingParams(temperature=0, max_tokens=10 + 3 * i, ignore_eos=True) for i in range(4)]
    # top_k=1 and a tiny top_p leave one token: the device's draw path must give the argmax too
    params += [
        SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=1e-6, max_tokens=12, ignore_eos=True),
    ]
    prompts = PROMPTS + PROMPTS[:2]
    want = [c.token_ids for c in _gen(host_llm, prompts, params)]
    got = _rid(llm, prompts, params)
    assert [c.token_ids for _, c in got] == want
    for rid, c in got:
        assert routes.device[rid] == len(c.token_ids) and routes.host[rid] == 0, rid


def test_grammar_constrained_rows_on_device(host_llm, device_llm):
    """The bitmask filled by the engine is applied on the device: greedy constrained rows equal
    the host's token for token, sampled ones are valid; a random model follows no format alone."""
    llm, routes = device_llm
    so_json = StructuredOutputsParams(json=SCHEMA)
    so_re = StructuredOutputsParams(regex=REGEX)
    params = [
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=so_json),
        SamplingParams(temperature=0, max_tokens=30, structured_outputs=so_re),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),  # unconstrained, same batch
    ]
    params += [SamplingParams(temperature=1.0, max_tokens=60, structured_outputs=so_json)] * 3
    params += [SamplingParams(temperature=1.2, top_k=50, max_tokens=30, structured_outputs=so_re)] * 3
    prompts = ["Hi", "The quick", "Hello", "A", "B", "C", "D", "E", "F"]
    want = [c.token_ids for c in _gen(host_llm, prompts[:3], params[:3])]
    got = _rid(llm, prompts, params)
    assert [c.token_ids for _, c in got[:3]] == want
    for i, (rid, c) in enumerate(got):
        assert routes.device[rid] == len(c.token_ids) and routes.host[rid] == 0, rid
        if params[i].structured_outputs is so_json:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)
        elif params[i].structured_outputs is so_re:
            assert c.finish_reason == "stop" and re.fullmatch(REGEX, c.text), c.text


def test_rows_needing_the_host_sampler_share_the_batch(host_llm, device_llm):
    """Seeded, logprobs, penalties, logit bias, allowed_token_ids, bad_words, min-p and min_tokens
    rows go to the host sampler and come out exactly as with device sampling off; the greedy rows
    beside them on the device."""
    llm, routes = device_llm
    host_only = {
        "seeded": SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
        "seeded_top_k": SamplingParams(temperature=0.9, top_k=20, seed=8, max_tokens=12, ignore_eos=True),
        "logprobs": SamplingParams(temperature=0, logprobs=3, max_tokens=10, ignore_eos=True),
        "penalty": SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=12, ignore_eos=True),
        "bias": SamplingParams(temperature=0, logit_bias={300: 5.0}, max_tokens=8, ignore_eos=True),
        "min_p": SamplingParams(temperature=0, min_p=0.2, max_tokens=8, ignore_eos=True),
        "allowed": SamplingParams(temperature=0, allowed_token_ids=[300, 301], max_tokens=8, ignore_eos=True),
        "bad_words": SamplingParams(temperature=0, bad_words=["fox", "cache"], max_tokens=8, ignore_eos=True),
    }
    device_ok = {
        "greedy": SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        "greedy_regex": SamplingParams(
            temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=REGEX)
        ),
    }
    min_tokens = SamplingParams(temperature=0, min_tokens=4, max_tokens=10)
    names = [*host_only, *device_ok, "min_tokens"]
    params = [*host_only.values(), *device_ok.values(), min_tokens]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    want = _gen(host_llm, prompts, params)
    got = _rid(llm, prompts, params)
    for name, w, (rid, c) in zip(names, want, got):
        assert c.token_ids == w.token_ids, name
        assert name != "allowed" or set(c.token_ids) <= {300, 301}
        n = len(c.token_ids)
        if name in host_only:
            assert routes.host[rid] == n and routes.device[rid] == 0, name
        elif name in device_ok:
            assert routes.device[rid] == n and routes.host[rid] == 0, name
        else:  # min_tokens: on the host while it bans the stop tokens, then on the device
            assert routes.host[rid] == 4 and routes.device[rid] == n - 4, name
    lp_want, lp_got = want[names.index("logprobs")].logprobs, got[names.index("logprobs")][1].logprobs
    assert [sorted(e) for e in lp_got] == [sorted(e) for e in lp_want]
    for e_got, e_want in zip(lp_got, lp_want):
        assert all(abs(e_got[t] - e_want[t]) < 1e-5 for t in e_want)


def test_unseeded_draws_follow_the_engine_seed(tiny_llama_dir):
    """Unseeded rows on the device draw from the runner's generator, seeded with the engine's
    seed: the same engine seed and batch repeat, another seed differs, and the draws are draws."""
    params = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def sample(seed: int) -> list[list[int]]:
        llm = _engine(tiny_llama_dir, on=True, seed=seed)
        return [c.token_ids for c in _gen(llm, PROMPTS, [params] * len(PROMPTS))]

    first, again, other = sample(1), sample(1), sample(2)
    assert first == again
    assert first != other
    argmax = [c.token_ids for c in _gen(_engine(tiny_llama_dir, on=True), PROMPTS, [greedy] * len(PROMPTS))]
    assert first != argmax


def test_speculative_verification_stays_on_the_host(tiny_llama_dir, host_llm):
    """With n-gram speculation, steps that verify drafts send their k + 1 rows to the host
    sampler; steps without drafts sample on the device; greedy output is unchanged."""
    llm = _engine(tiny_llama_dir, on=True, speculative_method="ngram", num_speculative_tokens=3)
    routes = Routes(llm)
    prompt = "ab ab ab ab ab ab ab ab ab ab"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = _gen(host_llm, [prompt], [params])[0].token_ids
    [(rid, got)] = _rid(llm, [prompt], [params])
    assert got.token_ids == want
    assert routes.device[rid] >= 1  # at least the first token (no drafts before the prompt is done)
    assert routes.device[rid] < len(want)  # some tokens came from verification steps


def test_step_and_output_cross_processes():
    """What a multi-rank engine sends and receives: the list and bitmask, and the token ids."""
    bitmask = torch.tensor([[-1, 5], [7, 0]], dtype=torch.int32)
    spec = DeviceSampling(["a", "b", "c"], [0.0, 0.7, 1.0], [0, 5, 0], [1.0, 0.9, 1.0], [0, 2],
                          bitmask.numpy().tobytes())  # fmt: skip
    step = decode_step(encode_step(StepInput(device_sampling=spec)))
    assert step.device_sampling == spec
    assert decode_step(encode_step(StepInput())).device_sampling is None
    out = RunnerOutput(["x"], [("y", 1)], torch.ones(3, 4), sampled={"a": 3, "c": 9})
    back = decode_output(encode_output(out))
    assert back.sampled == {"a": 3, "c": 9} and back.sample_req_ids == ["x"] and back.logits.shape == (3, 4)


def test_runner_splits_rows_and_keeps_the_host_rows_in_order():
    """Listed sample rows become token ids (a constrained one masked); the rest (host sample
    rows, then verification rows) stay logits, in order; listed ids without a row are ignored."""
    from kvserve.worker.device_sampling import sample_listed_rows

    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    logits[2, 7] = 100.0  # row "c"'s argmax, which its bitmask forbids
    allowed = torch.full((1, 2), 0, dtype=torch.int32)
    allowed[0, 1] = 1 << 3  # only token 35
    spec = DeviceSampling(["zz", "c", "a"], [0.0, 0.0, 0.0], [0, 0, 0], [1.0, 1.0, 1.0], [1],
                          allowed.numpy().tobytes())  # fmt: skip
    out = RunnerOutput(["a", "b", "c"], [("v", 1)])
    sample_listed_rows(out, logits.clone(), spec, torch.Generator())
    assert out.sampled == {"a": int(logits[0].argmax()), "c": 35}
    assert out.sample_req_ids == ["b"]
    assert torch.equal(out.logits, logits[[1, 3, 4]])
    # nothing listed has a row: everything goes to the host, as without device sampling
    out = RunnerOutput(["b"], [])
    sample_listed_rows(out, logits[:1].clone(), spec, torch.Generator())
    assert out.sampled == {} and out.sample_req_ids == ["b"] and torch.equal(out.logits, logits[:1])


def test_a_failing_request_fails_alone_beside_device_rows(host_llm, device_llm, monkeypatch):
    """The sampling fault hook's requests stay on the host sampler, where it raises: the
    engine's poison-request isolation still finds them while the others sample on the device."""
    from kvserve.model.layers.sampler import FAULT_INJECTION_ENV

    llm, routes = device_llm
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = _gen(host_llm, PROMPTS[:2], [params] * 2)
    monkeypatch.setenv(FAULT_INJECTION_ENV, "poison")
    engine = llm.llm_engine
    for rid, prompt in [("poison", PROMPTS[2]), ("ok-0", PROMPTS[0]), ("ok-1", PROMPTS[1])]:
        engine.add_request(rid, prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    assert final["poison"].finish_reason == "error" and routes.device["poison"] == 0
    for i in range(2):
        assert final[f"ok-{i}"].token_ids == want[i].token_ids
        # more than one draw a token: the failed step and its probes (step_recovery.py) sampled too
        assert routes.device[f"ok-{i}"] > len(want[i].token_ids) and routes.host[f"ok-{i}"] == 0


def test_n_samples_draw_their_first_token_on_the_host(host_llm, device_llm):
    """n > 1: the siblings' first tokens come from the leader's logits row on the host (with
    the leader's own), every later token from the device; greedy siblings all equal the host's."""
    llm, routes = device_llm
    params = SamplingParams(n=3, temperature=0, max_tokens=9, ignore_eos=True)
    want = host_llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs
    before = set(routes.device) | set(routes.host)
    got = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    siblings = (set(routes.device) | set(routes.host)) - before
    assert len(siblings) == 3
    assert sorted(routes.host[rid] for rid in siblings) == [0, 0, 1]  # only the leader's row
    assert all(routes.device[rid] == 8 for rid in siblings)
