"""A batch input file as the gateway forwards it: one alias for all its lines, each line's
`body.model` replaced by the chosen deployment's own model name (as a request's `model` is).

OpenAI runs a batch on one model, and a file lives on one backend, so the file's lines must
agree on the alias; a line that is no JSON object (or has no model) is passed on as it is, for
the backend to answer as an error line, as it would without the gateway."""

from __future__ import annotations

import json
from collections.abc import Callable

from kvserve.gateway.errors import GatewayError
from kvserve.routing.responses_ids import public_response


def _parsed(raw: bytes) -> dict | None:
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) and isinstance(obj.get("body"), dict) else None


def file_alias(data: bytes, allowed: list[str]) -> str:
    """The alias the file's lines name (one, and one this key may use), or a 400 / 404 naming
    the line that breaks it."""
    alias: str | None = None
    first = 0
    for n, raw in enumerate(data.splitlines(), 1):
        obj = _parsed(raw)
        model = obj["body"].get("model") if obj else None
        if not isinstance(model, str):
            continue
        if model not in allowed:
            raise GatewayError(
                404,
                f"file: line {n}: model {model[:200]!r} does not exist",
                code="model_not_found",
                param="file",
            )
        if alias is None:
            alias, first = model, n
        elif model != alias:
            raise GatewayError(
                400,
                f"file: line {n} names model {model[:200]!r}, line {first} {alias!r}: a batch runs on one "
                "model (as OpenAI's); split the file by model",
                param="file",
            )
    if alias is None:
        raise GatewayError(
            400, "file: no line names a model (body.model): the gateway routes a batch by it", param="file"
        )
    return alias


def for_backend(data: bytes, backend_model: str) -> bytes:
    """The file with each line's body.model as the backend names the model."""
    out = []
    for raw in data.splitlines(keepends=True):
        obj = _parsed(raw)
        if obj is None or not isinstance(obj["body"].get("model"), str):
            out.append(raw)
            continue
        obj["body"]["model"] = backend_model
        out.append(json.dumps(obj).encode() + b"\n")
    return b"".join(out)


def public_lines(first: bytes, dep_id: str, backend_model: str, alias: str) -> Callable[[bytes], bytes]:
    """How a file's lines go to the client, chosen by its first line (one parse, not one a line
    of a large output file): an input file's (lines with a `body`) with body.model the alias the
    client named again, as it uploaded them (the backend holds the deployment's model name: a
    downloaded file uploaded again was a 404 for a model the client never named); an output
    file's through public_output_line."""
    if _parsed(first) is None:
        return lambda line: public_output_line(line, dep_id)

    def input_line(line: bytes) -> bytes:
        obj = _parsed(line)
        if obj is None or obj["body"].get("model") != backend_model:
            return line
        obj["body"]["model"] = alias
        return json.dumps(obj).encode()

    return input_line


def public_output_line(line: bytes, dep_id: str) -> bytes:
    """An output line of a `/v1/responses` batch with the stored Response's ids as the gateway
    hands them out (routing/responses_ids.py): the backend's own id in it was a 404 at the
    gateway's GET /v1/responses/{id}, and as a later request's previous_response_id. Other lines
    as they came."""
    if b"resp_" not in line:
        return line
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return line
    body = (
        obj.get("response", {}).get("body")
        if isinstance(obj, dict) and isinstance(obj.get("response"), dict)
        else None
    )
    if not isinstance(body, dict) or body.get("object") != "response":
        return line
    public_response(body, dep_id)
    return json.dumps(obj).encode()
