"""The ranges a request's numbers are checked against, in one place.

Pydantic checks these at the boundary, before anything is registered, so a value the engine
cannot represent (a seed past int64, a top_k that overflows a tensor, NaN) is a 400 naming
the field instead of an exception inside a step. Limits that depend on the served model or
the server's settings (vocabulary size, max_model_len, seats) are checked by the input
processor and the handlers, against the same engine limits.

Seeds and priorities must fit int64 (they are refused outside it, not hashed into range); the
n samples of one request use seed, seed + 1, ..., wrapping around inside int64.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_N = 128  # choices per request (and never more than the server's --max-num-seqs)
MAX_LOGPROBS = 20  # top alternatives per token: OpenAI's limit, and serve's --max-logprobs default
MAX_STOP_STRINGS = 32
MAX_BAD_WORDS = 1024  # each is tokenized on the event loop and matched at every step of the request
MAX_PROMPTS = 2048  # entries of a completions prompt list or an embeddings input list, as OpenAI documents
MAX_SEQUENCES = 2048  # engine requests one chat / completions request may queue: prompts x samples

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
NonNegInt64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
PositiveInt64 = Annotated[int, Field(ge=1, le=INT64_MAX)]
TopK = Annotated[int, Field(ge=-1, le=INT64_MAX)]  # -1 or 0: off; checked against the vocabulary too
NumChoices = Annotated[int, Field(ge=1, le=MAX_N)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]  # the Responses API's (OpenAI's) range
# chat's top_logprobs, completions' logprobs, prompt_logprobs: up to the server's --max-logprobs
# (check_logprobs), which vLLM lets an operator raise past OpenAI's 20
ServedLogprobs = NonNegInt64
# OpenAI's rule for `metadata`: at most 16 pairs, keys up to 64 and values up to 512 characters (a
# response stores and echoes it: any size was taken)
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]], Field(max_length=16)
]


def check_logprobs(field: str, value: int | None, cap: int) -> None:
    """Refuse more top alternatives than the server's --max-logprobs (`cap`) allows."""
    if value is not None and value > cap:
        raise ValueError(f"{field}: {value} is more than this server allows ({cap}; serve's --max-logprobs)")


def sample_seed(seed: int, index: int) -> int:
    """The seed of the index-th sample of a request seeded with `seed`, kept inside int64."""
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN


def check_fan_out(num_prompts: int, n: int, best_of: int | None, seats: int) -> None:
    """Refuse a request whose prompts x max(n, best_of) would queue more than MAX_SEQUENCES
    engine requests: each holds memory from the moment it is queued, so one body of a
    million short prompts could otherwise exhaust the server. Nor may one prompt's samples
    outnumber the `seats` (max_num_seqs): they run together. ValueError names the field."""
    if num_prompts > MAX_PROMPTS:
        raise ValueError(f"prompt: {num_prompts} prompts in one request; at most {MAX_PROMPTS}")
    samples = max(n, best_of or 0)
    field = "best_of" if samples > n else "n"
    if samples > seats:
        raise ValueError(f"{field}: {samples} samples can never run at once here (max_num_seqs={seats})")
    if num_prompts * samples > MAX_SEQUENCES:
        raise ValueError(
            f"{field}: {num_prompts} prompt(s) x {field}={samples} is {num_prompts * samples} sequences; "
            f"at most {MAX_SEQUENCES} in one request (send the prompts in several requests)"
        )
