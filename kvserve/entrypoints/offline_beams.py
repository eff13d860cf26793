"""`LLM.beam_search`'s answer in vLLM's shape, from the engine's beam search results."""

from __future__ import annotations

import re

from kvserve.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from kvserve.tokenizer import Tokenizer

_PROMPT_ERROR = re.compile(r"^prompt (\d+): (n: )?")


def beam_error(message: str, offset: int) -> str:
    """generate's refusal in beam_search's words: the prompt's own index (generate saw a chunk
    of `concurrency_limit` prompts starting at `offset`), and `beam_width` for its `n`."""

    def renamed(m: re.Match) -> str:
        return f"prompt {int(m[1]) + offset}: " + ("beam_width: " if m[2] else "")

    return _PROMPT_ERROR.sub(renamed, message, count=1)


def as_beam_search_output(out: RequestOutput, keep_eos: bool, tokenizer: Tokenizer) -> BeamSearchOutput:
    """As vLLM's: tokens and text hold the prompt too, the text decoded with special tokens (its
    `decode(tokens)`), and the end-of-sequence token that ended a beam is left out unless
    include_stop_str_in_output (`keep_eos`)."""
    sequences = []
    for c in out.outputs:
        if c.finish_reason == "abort":  # a slot beyond the beams the search found
            continue
        generated = list(c.token_ids)
        if c.finish_reason == "stop" and c.stop_reason is None and not keep_eos:
            generated = generated[:-1]
        tokens = list(out.prompt_token_ids) + generated
        text = tokenizer.decode(tokens, skip_special_tokens=False)
        sequences.append(
            BeamSearchSequence(tokens, [], c.cumulative_logprob or 0.0, text, c.finish_reason, c.stop_reason)
        )
    return BeamSearchOutput(sequences)
