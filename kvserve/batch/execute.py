"""Run one batch line through the same handler as an HTTP request to its endpoint
(OpenAIServing.chat / .completion / .embeddings, ResponsesServing.create), at background
priority, and turn what it returns or raises into (status code, body) — the body an HTTP
client would have received."""

from __future__ import annotations

import asyncio
import json

from pydantic import ValidationError
from starlette.requests import Request as StarletteRequest

from kvserve.engine.async_llm import EngineDeadError, RequestFailedError
from kvserve.entrypoints.openai.compat import ModelNotFoundError
from kvserve.entrypoints.openai.errors import field_path, param_of, specific_error, value_error_code
from kvserve.entrypoints.openai.lifecycle import ServerShuttingDownError
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from kvserve.entrypoints.openai.responses import ResponsesServing
from kvserve.entrypoints.openai.responses_protocol import ResponsesRequest
from kvserve.entrypoints.openai.serving import OpenAIServing, ServerOverloadedError
from kvserve.request import BACKGROUND_PRIORITY

BODIES = {
    "/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest, "/v1/responses": ResponsesRequest,
}  # fmt: skip


class TransientError(Exception):
    """The engine cannot take the line right now (restarting, overloaded, draining): retry it."""


def _error(status: int, message: str, type_: str, param: str | None, code) -> tuple[int, dict]:
    return status, {"error": {"message": message, "type": type_, "param": param, "code": code}}


async def _never_disconnects() -> dict:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


def synthetic_request(endpoint: str, request_id: str) -> StarletteRequest:
    """What the handlers read from an HTTP request: headers, state (request_id, and batch_line,
    which no HTTP client can set), is_disconnected."""
    scope = {
        "type": "http", "method": "POST", "path": endpoint, "headers": [], "query_string": b"",
        # batch_line: outside --max-waiting-requests (the runner's window bounds batch lines)
        "state": {"request_id": request_id, "batch_line": True},
    }  # fmt: skip
    return StarletteRequest(scope, _never_disconnects)


async def execute_line(
    serving: OpenAIServing, endpoint: str, body: dict, request_id: str,
    responses: ResponsesServing | None = None,
) -> tuple[int, dict]:  # fmt: skip
    """(HTTP status, JSON body) of one line; TransientError when it should be retried later.
    `responses` runs /v1/responses lines (its store keeps what they store, as over HTTP)."""
    try:
        req = BODIES[endpoint].model_validate(body)
    except ValidationError as e:
        first = specific_error(list(e.errors()))  # as the HTTP handler reports it
        loc = list(first.get("loc", []))
        param = str(loc[0]) if loc else None
        where = field_path(loc) if loc else "body"
        return _error(400, f"{where}: {first.get('msg', 'invalid value')}", "invalid_request_error", param,
                      "invalid_value")  # fmt: skip
    if endpoint != "/v1/responses":  # (a response's chat request is given it: responses.py)
        req.priority = BACKGROUND_PRIORITY  # a batch line never competes with a waiting human
    raw = synthetic_request(endpoint, request_id)
    try:
        if endpoint == "/v1/chat/completions":
            resp = await serving.chat(req, raw)
        elif endpoint == "/v1/embeddings":
            return 200, await serving.embeddings(req, raw)  # a dict, as the route returns it
        elif endpoint == "/v1/responses":
            assert responses is not None, "a /v1/responses batch needs the ResponsesServing"
            resp = await responses.create(req, raw)
        else:
            resp = await serving.completion(req, raw)
    except (ServerOverloadedError, ServerShuttingDownError) as e:
        raise TransientError(str(e)) from e
    except EngineDeadError as e:
        raise TransientError(str(e)) from e
    except ModelNotFoundError as e:
        return _error(404, str(e), "invalid_request_error", "model", "model_not_found")
    except ValueError as e:
        return _error(400, str(e), "invalid_request_error", param_of(str(e)), value_error_code(e))
    except RequestFailedError as e:
        return _error(500, str(e), "internal_error", None, "engine_error")
    except TimeoutError as e:
        return _error(504, str(e), "timeout", None, "timeout")
    return resp.status_code, json.loads(resp.body)
