"""The OpenAPI document as the server really answers: FastAPI documents a 422 for every body,
but validation errors here are 400s in OpenAI's error shape."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}


def openapi_with_400(app: FastAPI) -> dict:
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for operations in doc.get("paths", {}).values():
        for op in operations.values():
            responses = op.get("responses", {})
            if responses.pop("422", None) is not None:
                responses["400"] = {
                    "description": "Invalid request (OpenAI error shape, naming the field)",
                    "content": {"application/json": {"schema": ref}},
                }
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["ErrorResponse"] = ERROR_SCHEMA
    app.openapi_schema = doc
    return doc
