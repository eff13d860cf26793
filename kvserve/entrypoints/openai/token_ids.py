"""vLLM's `return_token_ids`: the prompt's token ids and each choice's generated ones in the
answer (RL and evaluation clients read them instead of re-tokenizing the text, which does not
round-trip). Streamed, every generated id goes out exactly once, in order: a chunk held back
for its text (a possible stop string's start) keeps its ids for the next chunk that is sent."""

from __future__ import annotations

from kvserve.outputs import RequestOutput


class StreamedTokenIds:
    """Per choice, the generated ids not sent yet."""

    def __init__(self) -> None:
        self._pending: dict[int, list[int]] = {}

    def add(self, index: int, out: RequestOutput) -> None:
        self._pending.setdefault(index, []).extend(out.outputs[0].delta_token_ids)

    def pending(self, index: int) -> bool:
        return bool(self._pending.get(index))

    def take(self, index: int) -> list[int]:
        return self._pending.pop(index, [])
