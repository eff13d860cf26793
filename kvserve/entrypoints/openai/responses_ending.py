"""How a streamed response ends before its last token: failed, or cancelled.

The engine failing mid-stream (the request's step raised, the engine died, the server shuts
down, the request timed out) ends the stream as OpenAI's does: an `error` event, then
`response.failed` whose response carries the error. A request the engine refused for its own
parameters once streaming (RequestRefusedError) is the client's error: its event's code is a
400's, `invalid_value`, naming the field, and the response's error OpenAI's `invalid_prompt`,
not `server_error`. A client that leaves mid-stream stops
the generation (as OpenAI's non-background stream does); the response is kept as
`cancelled` with what was written, so GET and previous_response_id find the id the client
was already given in `response.created`. Either way, the items still open are "incomplete".
"""

from __future__ import annotations

from kvserve.engine.async_llm import EngineDeadError, RequestFailedError, RequestRefusedError
from kvserve.entrypoints.openai.lifecycle import ServerShuttingDownError

# the errors a stream ends on (the chat stream's error event names them with the same codes)
STREAM_FAILURES = (EngineDeadError, ServerShuttingDownError, RequestFailedError, TimeoutError)
# (in order: RequestRefusedError is a RequestFailedError)
_CODES = {EngineDeadError: "engine_dead", ServerShuttingDownError: "shutting_down",
          RequestRefusedError: "invalid_value", RequestFailedError: "engine_error",
          TimeoutError: "timeout"}  # fmt: skip


def failure_code(error: BaseException) -> str:
    """The error event's code for one of STREAM_FAILURES."""
    return next(code for kind, code in _CODES.items() if isinstance(error, kind))


def response_error_code(error: BaseException) -> str:
    """The failed response's error code (OpenAI's Response.error takes a few): the client's
    request for a refusal, else the server's fault."""
    return "invalid_prompt" if isinstance(error, RequestRefusedError) else "server_error"


def end_early(
    response: dict, output: list[dict], status: str, message: str | None = None, code: str = "server_error"
) -> dict:
    """`response` (still in progress) ended as `status`, "failed" (with `message`, under `code`:
    response_error_code's) or "cancelled"; `output`: the items written so far. Usage stays
    null: the engine's count comes with the last chunk."""
    for item in output:
        if item["status"] == "in_progress":
            item["status"] = "incomplete"
    response["output"] = output
    response["status"] = status
    if message is not None:
        response["error"] = {"code": code, "message": message}
    return response
