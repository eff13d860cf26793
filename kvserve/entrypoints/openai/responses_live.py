"""Stored responses still streaming: found by id before they reach the store.

A streamed response is stored when it ends (responses.py), but its id reaches the client in
`response.created`, at once. OpenAI's GET of a stored response then answers it `in_progress`;
here it was a 404 until the stream ended, so a client polling the id it was given (or a UI
opened in a second tab) read "not found". The live ones are held here, in this process only
(a restart ends their streams too), until the stream stores them; a DELETE meanwhile means
they are not stored at all.
"""

from __future__ import annotations

import copy


class LiveResponses:
    """Responses by id whose stream is running (only those to be stored: store=true)."""

    def __init__(self) -> None:
        # id -> (the response being written, its output items so far, its input items)
        self._live: dict[str, tuple[dict, list[dict], list[dict]]] = {}
        self._deleted: set[str] = set()  # deleted while live: not to be stored when they end

    def add(self, response: dict, output: list[dict], input_items: list[dict]) -> None:
        """`response` and `output` are the stream's own, read as they are written."""
        self._live[response["id"]] = (response, output, input_items)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._live

    def snapshot(self, response_id: str) -> dict | None:
        """The response as it stands (in_progress, its items so far), or None if not live."""
        if response_id not in self._live:
            return None
        response, output, _ = self._live[response_id]
        return copy.deepcopy({**response, "output": output})

    def input_items(self, response_id: str) -> list[dict] | None:
        held = self._live.get(response_id)
        return None if held is None else held[2]

    def end(self, response_id: str) -> bool:
        """The stream is over: whether to store it (not if it was deleted meanwhile)."""
        self._live.pop(response_id, None)
        if response_id in self._deleted:
            self._deleted.discard(response_id)
            return False
        return True

    def delete(self, response_id: str) -> bool:
        """Forget a live response (its stream goes on, unstored); False if none is live."""
        if self._live.pop(response_id, None) is None:
            return False
        self._deleted.add(response_id)
        return True
