"""One input line of a batch file: `{"custom_id", "method": "POST", "url", "body"}` checked
here, and the output records (OpenAI's shape) for a response or a line that could not run."""

from __future__ import annotations

import json
import secrets

from kvserve.tokenizer import lone_surrogate


class LineError(ValueError):
    """A line that cannot be run; it becomes an error line, the batch goes on."""

    def __init__(self, message: str, code: str = "invalid_request", custom_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.custom_id = custom_id


def parse_line(raw: bytes, endpoint: str) -> tuple[str, dict]:
    """(custom_id, body) of a line, or LineError naming what is wrong."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise LineError(f"line is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(obj, dict):
        raise LineError("line: must be a JSON object", "invalid_json")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("custom_id: required, a non-empty string", "missing_custom_id")
    if lone_surrogate(custom_id) is not None:
        raise LineError(
            "custom_id: must be valid Unicode text (it holds a lone surrogate such as \\ud800)",
            "invalid_custom_id",
        )
    if obj.get("method", "POST") != "POST":
        raise LineError(f"method: {obj.get('method')!r} is not supported (POST)", "invalid_method", custom_id)
    if obj.get("url") != endpoint:
        raise LineError(
            f"url: {obj.get('url')!r} does not match the batch's endpoint {endpoint!r}",
            "invalid_url",
            custom_id,
        )
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError("body: required, a JSON object", "invalid_body", custom_id)
    if body.get("stream"):
        raise LineError("body.stream: streaming is not available in a batch", "invalid_body", custom_id)
    if endpoint == "/v1/responses" and body.get("background"):  # HTTP's advice (stream=true) is refused here
        raise LineError(
            "body.background: a batch line already runs in the background; leave background out",
            "invalid_body",
            custom_id,
        )
    return custom_id, body


def sequences(body: dict, endpoint: str = "/v1/chat/completions") -> int:
    """The engine requests a line's body fans out to, prompts (or embeddings inputs) x max(n,
    best_of), as far as its shape tells (a value of the wrong type counts 1: validation refuses
    the line anyway). A response is one: its `input` is one conversation's items."""
    if endpoint == "/v1/responses":
        return 1

    def count(value) -> int:
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1

    prompt = body.get("prompt", body.get("input"))  # completions' prompt, embeddings' input
    prompts = len(prompt) if isinstance(prompt, list) and any(not isinstance(p, int) for p in prompt) else 1
    return prompts * max(count(body.get("n")), count(body.get("best_of")))


def _req_id() -> str:
    return "batch_req_" + secrets.token_hex(12)


def response_record(custom_id: str, status: int, request_id: str, body: dict) -> dict:
    return {
        "id": _req_id(), "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None,
    }  # fmt: skip


def error_record(err: LineError) -> dict:
    return {"id": _req_id(), "custom_id": err.custom_id, "response": None,
            "error": {"code": err.code, "message": str(err)}}  # fmt: skip
