"""A client mistake on the files / batches routes: becomes a 400/404 in OpenAI's shape."""

from __future__ import annotations


class BatchAPIError(Exception):
    def __init__(self, status: int, message: str, param: str | None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def not_found(kind: str, ident: str, param: str) -> BatchAPIError:
    return BatchAPIError(404, f"{param}: no {kind} with id {ident!r}", param, code="not_found")
