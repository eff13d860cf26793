"""The offline `LLM`'s logprobs as vLLM's: `dict[int, Logprob]`, not `dict[int, float]`.

Code written for vLLM reads `lp[tok].logprob`, `.rank` and `.decoded_token`; with plain floats
it raised AttributeError. The values are converted once a request has finished, in place, so
every list holding these dicts (logprobs, text_logprobs) sees the same objects.
"""

from __future__ import annotations

from kvserve.outputs import Logprob, RequestOutput
from kvserve.tokenizer import Tokenizer


def to_vllm_logprobs(
    out: RequestOutput, top_k: int | None, prompt_top_k: int | None, tokenizer: Tokenizer
) -> None:
    """Make the finished `out`'s logprob values `Logprob`s; `top_k` / `prompt_top_k` are the
    alternatives asked for (SamplingParams.logprobs / .prompt_logprobs), which bound the ranks
    that are known."""
    texts: dict[int, str] = {}  # a token's text, decoded once per call

    def text(token: int) -> str:
        if token not in texts:  # as vLLM's decoded_token: the token alone, special tokens kept
            texts[token] = tokenizer.decode([token], skip_special_tokens=False)
        return texts[token]

    prompt_ranks = out.prompt_logprob_ranks or []
    for j, entry in enumerate(out.prompt_logprobs or ()):
        if entry is not None:
            own = (out.prompt_token_ids[j], prompt_ranks[j]) if j < len(prompt_ranks) else None
            _convert(entry, prompt_top_k or 0, text, own)
    for completion in out.outputs:
        ranks = completion.logprob_ranks or []
        for i, entry in enumerate(completion.logprobs or ()):
            sampled = (completion.token_ids[i], ranks[i]) if i < len(ranks) else None
            _convert(entry, top_k or 0, text, sampled)


def _convert(entry: dict[int, float], k: int, text, sampled: tuple[int, int | None] | None = None) -> None:
    """A token's rank is 1 + the tokens with a higher logprob. The entry holds the k best, so
    when fewer than k of its tokens beat one, every token beating it is here and the rank is
    exact; otherwise tokens outside the entry may beat it too, and it is None, except for the
    sampled (or prompt) token, whose rank the engine counted over the whole vocabulary (`sampled`)."""
    values = sorted(entry.values(), reverse=True)
    for token, value in entry.items():
        if isinstance(value, Logprob):
            continue  # converted already (an output returned twice)
        better = _count_above(values, value)
        rank = better + 1 if better < k else None
        if sampled is not None and token == sampled[0] and sampled[1] is not None:
            rank = sampled[1]
        entry[token] = Logprob(value, rank, text(token))


def _count_above(descending: list[float], value: float) -> int:
    n = 0
    while n < len(descending) and descending[n] > value:
        n += 1
    return n
