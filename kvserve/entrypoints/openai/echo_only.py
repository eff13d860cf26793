"""Scoring a prompt: a completion with `echo: true` and `max_tokens: 0` answers the prompt alone
(with its logprobs when asked), as OpenAI's legacy completions and vLLM do; evaluation harnesses
score prompts this way. The engine samples at least one token, so the request runs with
max_tokens 1 and that token is hidden here: from the text, the logprobs and the usage."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from kvserve.outputs import CompletionOutput, RequestOutput


def engine_max_tokens(max_tokens: int, echo: bool) -> int:
    """The engine's limit for a request's max_tokens; 0 is only the prompt, so needs echo."""
    if max_tokens == 0 and not echo:
        raise ValueError("max_tokens: must be at least 1 (0 only with echo=true: the prompt scored alone)")
    return max(max_tokens, 1)


Outputs = AsyncIterator[tuple[int, RequestOutput]]


async def prompt_only(gen: Outputs) -> Outputs:
    """`gen`'s outputs with nothing generated: the one token sampled is not the answer's."""
    try:
        async for index, out in gen:
            yield index, _without_output(out)
    finally:
        await gen.aclose()


def _without_output(out: RequestOutput) -> RequestOutput:
    c = out.outputs[0]
    failed = c.finish_reason in ("abort", "error")  # kept: the client must see those
    finish = c.finish_reason if failed or c.finish_reason is None else "length"  # as OpenAI's 0 tokens
    empty = [] if c.logprobs is not None else None
    hidden = CompletionOutput(
        index=c.index, text="", token_ids=[], finish_reason=finish,
        stop_reason=c.stop_reason if failed else None,
        logprobs=empty, delta_logprobs=empty, text_logprobs=empty,
    )  # fmt: skip
    return dataclasses.replace(out, outputs=[hidden])
