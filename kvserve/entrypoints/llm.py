"""The offline API: `LLM(model=...).generate(prompts, params)` and `LLM.chat(messages, params)`."""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.entrypoints.chat_render import render_chat
from kvserve.entrypoints.llm_options import engine_options
from kvserve.entrypoints.offline_beams import as_beam_search_output, beam_error
from kvserve.entrypoints.offline_logprobs import to_vllm_logprobs
from kvserve.entrypoints.openai.limits import sample_seed
from kvserve.generation_defaults import generation_defaults
from kvserve.outputs import (
    BeamSearchOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from kvserve.sampling_params import BeamSearchParams, SamplingParams

# vLLM's prompt forms: text, token ids, or a dict naming one of them (TextPrompt: {"prompt": ...},
# TokensPrompt: {"prompt_token_ids": [...]}), either with an optional "cache_salt".
PromptType = str | Sequence[int] | dict[str, Any]
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _prompt_and_salt(prompt: PromptType) -> tuple[str | Sequence[int], str | None]:
    """A prompt as the engine takes it, and its cache salt. A dict was read as the list of its
    keys before (`{"prompt_token_ids": [...]}` generated from the text "prompt_token_ids")."""
    if not isinstance(prompt, dict):
        return prompt, None
    named = [k for k in _PROMPT_KEYS if k in prompt]
    if len(named) != 1:
        raise ValueError(
            f"a dict prompt names exactly one of {', '.join(_PROMPT_KEYS)}; got keys {sorted(prompt)}"
        )
    unknown = sorted(set(prompt) - {*_PROMPT_KEYS, "cache_salt"})
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not supported in a prompt (text and token ids only)")
    return prompt[named[0]], prompt.get("cache_salt")


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt or a list of them, as a list. One prompt of token ids is a list, tuple or
    array whose first element is an integer (numpy's was taken as a list of prompts, and an
    array's truth value raised)."""
    head = prompts[0] if not isinstance(prompts, str | dict) and len(prompts) else None
    if isinstance(prompts, str | dict) or (isinstance(head, numbers.Integral) and not isinstance(head, bool)):
        return [prompts]
    return list(prompts)


def _no_lora(lora_request: Any) -> None:
    """vLLM's methods take a LoRA adapter; passing one here must not silently run the base model."""
    if lora_request is not None:
        raise ValueError("lora_request: LoRA adapters are not supported")


def _group_metrics(each: list[RequestMetrics]) -> RequestMetrics:
    """One prompt's n samples as one request, as vLLM reports them: it finished when its last
    sample did (the first sample's time was reported, so e2e_latency missed the longer ones)."""
    if len(each) == 1:
        return each[0]

    def earliest(name: str) -> float | None:
        times = [t for m in each if (t := getattr(m, name)) is not None]
        return min(times) if times else None

    finished = [m.finished_time for m in each]
    return RequestMetrics(
        arrival_time=min(m.arrival_time for m in each),
        first_scheduled_time=earliest("first_scheduled_time"),
        first_token_time=earliest("first_token_time"),
        finished_time=None if None in finished else max(finished),
        num_preemptions=sum(m.num_preemptions for m in each),
    )


def _params_list(given: Any) -> list[SamplingParams]:
    """A sequence of SamplingParams, one per prompt. A dict ({"max_tokens": 3}) was read as the
    list of its keys and failed in the engine with "'str' object has no attribute 'n'"."""
    if not isinstance(given, Sequence) or isinstance(given, str):
        hint = " (SamplingParams(**that_dict) takes it)" if isinstance(given, dict) else ""
        raise TypeError(
            f"sampling_params: expected SamplingParams or a list of them, got {type(given).__name__}{hint}"
        )
    for i, p in enumerate(given):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params[{i}]: expected SamplingParams, got {type(p).__name__}")
    return list(given)


def _progress_bar(use_tqdm: bool | Callable[..., tqdm], total: int) -> tqdm:
    """vLLM's use_tqdm: a bool, or a tqdm-like class / factory to draw the bar with."""
    make = use_tqdm if callable(use_tqdm) else tqdm
    return make(total=total, desc="generate", disable=not use_tqdm, unit="req")


class LLM:
    """Runs an in-process engine over a batch of prompts until all are done."""

    def __init__(self, model: str = "smollm2-135m", **engine_kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, **engine_options(model, engine_kwargs)))
        self.tokenizer = self.llm_engine.tokenizer
        self._ids = itertools.count()
        config = self.llm_engine.config
        self._defaults = generation_defaults(self.llm_engine.core.source, config.generation_config)
        try:
            SamplingParams(**self._defaults)
        except ValueError as e:
            raise ValueError(f"generation_config: the model's generation_config.json: {e}") from None

    def get_tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer, as vLLM's `LLM.get_tokenizer()` (scripts call its
        apply_chat_template / decode / eos_token_id); it was missing (an AttributeError)."""
        return self.tokenizer.hf

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no SamplingParams (a new object to edit), as
        vLLM's: the model's generation_config.json values (temperature, top_p, top_k, min_p,
        repetition_penalty, max_new_tokens as max_tokens) over SamplingParams()'s, unless
        LLM(generation_config="vllm"); they were ignored (kvserve/generation_defaults.py)."""
        return SamplingParams(**self._defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order, n completions each.
        The parameters are vLLM's, in its order (`lora_request` must be None: no LoRA here).

        `priority` (one per prompt, lower runs sooner) needs scheduling_policy="priority".
        """
        _no_lora(lora_request)
        prompts = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = _params_list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")

        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority: {len(priorities)} given for {len(prompts)} prompts")
        policy = self.llm_engine.config.scheduling_policy
        if any(priorities) and policy != "priority":  # as vLLM: it was silently ignored
            raise ValueError(f'priority: needs scheduling_policy="priority" (this LLM runs {policy})')
        engine = self.llm_engine
        groups: list[list[str]] = []
        added: list[str] = []
        try:
            for i, (given, p) in enumerate(zip(prompts, params)):
                try:
                    prompt, salt = _prompt_and_salt(given)
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from None
                ids = []
                group = f"group-{next(self._ids)}" if p.n > 1 else None
                for j in range(p.n):
                    # Each of the n samples is its own sequence sharing the prompt's KV blocks;
                    # seeds stay distinct per sample. With beam search the n requests are one
                    # search's result slots (engine/beam_search.py), n beams wide.
                    seed = None if p.seed is None else sample_seed(p.seed, j)  # as the server's n
                    rid = f"{next(self._ids)}"
                    one = replace(p, n=p.n if p.use_beam_search else 1, seed=seed)
                    try:
                        engine.add_request(
                            rid, prompt, one, priority=priorities[i], cache_salt=salt, group_id=group
                        )
                    except ValueError as e:
                        raise ValueError(f"prompt {i}: {e}") from None
                    added.append(rid)
                    ids.append(rid)
                groups.append(ids)
        except ValueError:
            engine.abort_request(added, report=False)  # leaves other callers' requests alone
            raise

        final: dict[str, RequestOutput] = {}
        mine = set(added)  # others' requests in the engine finish here too; they are not counted
        try:
            bar = _progress_bar(use_tqdm, len(added))
            while len(final) < len(added):
                for out in engine.step():
                    if out.finished and out.request_id in mine:
                        final[out.request_id] = out
                        bar.update(1)
            bar.close()
        except BaseException:
            # Interrupted (Ctrl-C in a notebook, an error in a step or a progress bar): this
            # call's requests kept running in the engine, and the next generate ran them too.
            engine.abort_request([rid for rid in added if rid not in final], report=False)
            raise

        results = []
        for ids, p in zip(groups, params):
            first = final[ids[0]]
            completions = []
            for j, rid in enumerate(ids):
                c = final[rid].outputs[0]
                c.index = j
                completions.append(c)
            out = replace(first, outputs=completions, metrics=_group_metrics([final[r].metrics for r in ids]))
            if p.logprobs is not None or p.prompt_logprobs is not None:
                vocab = self.llm_engine.processor.limits.vocab_size  # -1 asked for all of it
                top, prompt_top = (vocab if k == -1 else k for k in (p.logprobs, p.prompt_logprobs))
                to_vllm_logprobs(out, top, prompt_top, self.tokenizer)
            results.append(out)
        return results

    def beam_search(
        self,
        prompts: Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: None = None,
        use_tqdm: bool | Callable[..., tqdm] = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: the `beam_width` best sequences per prompt, best first, each
        holding the prompt's tokens and text too (it was missing: an AttributeError). The
        search is the engine's (transformers' beam arithmetic, docs/BEAM_SEARCH.md), so width 1
        is greedy; `concurrency_limit` runs the prompts that many at a time."""
        _no_lora(lora_request)
        if concurrency_limit is not None and (
            not isinstance(concurrency_limit, int) or concurrency_limit < 1
        ):
            raise ValueError(f"concurrency_limit: must be >= 1, got {concurrency_limit!r}")
        prompts = _prompt_list(prompts)
        sp = params.sampling_params()
        step = concurrency_limit or max(len(prompts), 1)
        outputs = []
        for i in range(0, len(prompts), step):
            try:
                outputs += self.generate(prompts[i : i + step], sp, use_tqdm=use_tqdm)
            except ValueError as e:
                raise ValueError(beam_error(str(e), offset=i)) from None
        keep_eos = params.include_stop_str_in_output
        return [as_beam_search_output(out, keep_eos, self.tokenizer) for out in outputs]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        use_tqdm: bool | Callable[..., tqdm] = True,
        pooling: str = "last",
        truncate_prompt_tokens: int | None = None,
        *,
        pooling_params: None = None,
        lora_request: None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One L2-normalized embedding per prompt ("last" or "mean" of the final hidden states),
        as vLLM's LLM.embed and the server's /v1/embeddings; it was missing (an AttributeError).
        vLLM's `pooling_params` and `lora_request` were a TypeError: None is taken, another value
        refused naming it (no PoolingParams here: `pooling` and `truncate_prompt_tokens` are)."""
        _no_lora(lora_request)
        if pooling_params is not None:
            raise ValueError(
                "pooling_params: not supported; pass pooling= (last, mean) and truncate_prompt_tokens="
            )
        params = SamplingParams(max_tokens=1, pooling=pooling, truncate_prompt_tokens=truncate_prompt_tokens)
        outputs = []
        for i, out in enumerate(self.generate(prompts, params, use_tqdm=use_tqdm)):
            if out.embedding is None:  # the engine failed it (finish_reason "error")
                raise RuntimeError(f"prompt {i}: no embedding: {out.outputs[0].stop_reason}")
            vector = out.embedding
            norm = max(math.sqrt(sum(x * x for x in vector)), 1e-12)
            outputs.append(
                EmbeddingRequestOutput(
                    out.request_id, out.prompt_token_ids, EmbeddingOutput([x / norm for x in vector])
                )
            )
        return outputs

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: None = None,
        pooling_task: str | None = "embed",
    ) -> list[PoolingRequestOutput]:
        """vLLM's LLM.encode for the one pooling task there is, "embed": `embed`'s vectors as torch
        tensors in `outputs.data` (it was missing: an AttributeError); another task is refused."""
        if pooling_task not in (None, "embed"):
            raise ValueError(
                f"pooling_task: {pooling_task!r} is not supported; only embed (this is a causal LM)"
            )
        import torch  # loaded with the engine already

        out = self.embed(
            prompts, use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens,
            pooling_params=pooling_params, lora_request=lora_request,
        )  # fmt: skip
        return [
            PoolingRequestOutput(
                o.request_id, o.prompt_token_ids, PoolingOutput(torch.tensor(o.outputs.embedding))
            )
            for o in out
        ]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template (the model's, or `chat_template`) to each conversation, then
        generate; each output's `prompt` is the rendered text, as vLLM's. The template options
        were missing (a TypeError), and `prompt` was None. The parameters are vLLM's, in its
        order; `chat_template_content_format` "openai" hands content parts to the template as
        the list, "auto" and "string" as their text joined by newlines."""
        _no_lora(lora_request)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        options = dict(
            chat_template=chat_template,
            content_format=chat_template_content_format,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        texts = [render_chat(self.tokenizer, c, **options) for c in conversations]
        prompts = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        for out, text in zip(outputs, texts):
            out.prompt = text
        return outputs
