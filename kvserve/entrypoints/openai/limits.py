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
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI documents
MAX_STOP_STRINGS = 32

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
NonNegInt64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
PositiveInt64 = Annotated[int, Field(ge=1, le=INT64_MAX)]
TopK = Annotated[int, Field(ge=-1, le=INT64_MAX)]  # -1 or 0: off; checked against the vocabulary too
NumChoices = Annotated[int, Field(ge=1, le=MAX_N)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


def sample_seed(seed: int, index: int) -> int:
    """The seed of the index-th sample of a request seeded with `seed`, kept inside int64."""
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN
