"""How a front (the gateway, the pd-proxy, the Ray Serve front) ends a stream whose backend
failed after it began: as `kvserve serve` ends one whose engine failed. A chat or completions
stream gets an error event in OpenAI's shape and then `data: [DONE]` (clients that read to
[DONE], such as LiteLLM's stream wrapper, otherwise wait on a stream that has ended); a
Responses stream gets the API's own numbered error event and no [DONE], as OpenAI sends it."""

from __future__ import annotations

import json

DONE = b"data: [DONE]\n\n"


def failed_stream_end(
    message: str, responses_api: bool = False, events_sent: int = 0, code: str = "upstream_error"
) -> bytes:
    """The last bytes of a failed stream. `events_sent`: the events the client has had (the
    error's sequence_number in a Responses stream, as kvserve serve numbers it). It starts with
    a blank line: an event the failure cut off in the middle ends there, not inside the error."""
    if responses_api:
        err = {"type": "error", "code": code, "message": message, "param": None}
        err["sequence_number"] = events_sent
        return b"\n\nevent: error\ndata: " + json.dumps(err).encode() + b"\n\n"
    err = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"\n\ndata: " + json.dumps(err).encode() + b"\n\n" + DONE


def count_events(chunk: bytes) -> int:
    """Whole events in a chunk of a stream relayed in whole events (the blank lines that end them)."""
    return chunk.replace(b"\r\n", b"\n").count(b"\n\n")
