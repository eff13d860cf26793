"""HTTP routes of the Files and Batches APIs, in OpenAI's shapes; client mistakes are 400/404
in OpenAI's error shape naming the field."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import BinaryIO, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from kvserve.batch.errors import BatchAPIError, not_found
from kvserve.batch.expiry import ExpiresAfter, form_expires_after
from kvserve.batch.files import CHUNK, FileStore, new_file_id, too_large
from kvserve.batch.jobs import JobStore
from kvserve.batch.service import BatchService
from kvserve.entrypoints.openai.errors import error_response
from kvserve.entrypoints.openai.listing import limit_problem, page
from kvserve.platform.memory import trim_heap

MULTIPART_SLACK = 64 * 1024  # form boundaries and fields around the file itself


class BatchCreateRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # fields of OpenAI's added later: accepted

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None


def _openai_errors(fn):
    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        try:
            return await fn(*args, **kwargs)
        except BatchAPIError as e:
            kind = "not_found_error" if e.status == 404 else "invalid_request_error"
            return error_response(e.status, e.message, kind, e.param, e.code)

    return wrapper


def _listing(fetch, limit: int, most: int) -> dict:
    """One list page, shared by the list routes: a `limit` outside [1, most] is refused, as
    OpenAI refuses it; one row more than the page is fetched, to tell has_more."""
    if problem := limit_problem(limit, most):
        raise BatchAPIError(400, problem[0], "limit", problem[1])
    data = fetch(limit + 1)
    return page(data[:limit], has_more=len(data) > limit)


def _copy_upload(files: FileStore, upload: UploadFile, purpose: str) -> str:
    """Copy the upload to the store (in a thread: it is disk work); returns the new id."""
    file_id = new_file_id()
    files.copy_in(upload.file, file_id, purpose)
    trim_heap()  # the multipart parser's buffers
    return file_id


def _chunks(f: BinaryIO) -> Iterator[bytes]:
    """A file's bytes from an open handle (read in Starlette's thread pool), closed at the end."""
    with f:
        while chunk := f.read(CHUNK):
            yield chunk


def batch_router(files: FileStore, jobs: JobStore, service: BatchService) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/files")
    @_openai_errors
    async def upload(request: Request):
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > files.max_upload_size + MULTIPART_SLACK:
            raise too_large(files.max_upload_size)
        try:
            form = await request.form(max_files=1, max_fields=16)
        except Exception as e:  # noqa: BLE001 - malformed multipart is the client's mistake
            raise BatchAPIError(400, f"file: the body is not a valid multipart form ({e})", "file") from None
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if not isinstance(purpose, str):
                raise BatchAPIError(400, "purpose: required (a form field, 'batch')", "purpose")
            if not isinstance(upload, UploadFile):
                raise BatchAPIError(400, "file: required (a file part)", "file")
            expires_after = form_expires_after(form)
            file_id = await run_in_threadpool(_copy_upload, files, upload, purpose)
            return files.register(file_id, upload.filename or "upload.jsonl", purpose, expires_after)
        finally:
            await form.close()

    @router.get("/v1/files")
    @_openai_errors
    async def list_files(
        purpose: str | None = None, limit: int = 10000, after: str | None = None,
        order: Literal["asc", "desc"] = "desc",
    ):  # fmt: skip
        return _listing(lambda n: files.list(purpose, n, after, order), limit, 10000)

    @router.get("/v1/files/{file_id}")
    @_openai_errors
    async def get_file(file_id: str):
        return files.get(file_id)

    @router.get("/v1/files/{file_id}/content")
    @_openai_errors
    async def file_content(file_id: str):
        files.get(file_id)
        try:  # opened now: a DELETE while it is sent cannot cut it short (it was a 500)
            f = open(files.path(file_id), "rb")
        except FileNotFoundError:  # its bytes removed behind the store's back
            raise not_found("file", file_id, "file_id") from None
        size = os.fstat(f.fileno()).st_size
        headers = {"content-length": str(size)}
        return StreamingResponse(_chunks(f), media_type="application/jsonl", headers=headers)

    @router.delete("/v1/files/{file_id}")
    @_openai_errors
    async def delete_file(file_id: str):
        return files.delete(file_id)

    @router.post("/v1/batches")
    @_openai_errors
    async def create_batch(req: BatchCreateRequest):
        f = files.get(req.input_file_id, param="input_file_id")
        if f["purpose"] != "batch":
            raise BatchAPIError(
                400, f"input_file_id: {req.input_file_id!r} has purpose {f['purpose']!r}, not 'batch'",
                "input_file_id",
            )  # fmt: skip
        expires = req.output_expires_after
        obj = jobs.create(
            req.input_file_id, req.endpoint, req.completion_window, req.metadata, expires and expires.seconds
        )
        service.submit(obj["id"])
        return obj

    @router.get("/v1/batches")
    @_openai_errors
    async def list_batches(limit: int = 20, after: str | None = None):
        return _listing(lambda n: jobs.list(n, after), limit, 100)

    @router.get("/v1/batches/{batch_id}")
    @_openai_errors
    async def get_batch(batch_id: str):
        return jobs.get(batch_id)

    @router.post("/v1/batches/{batch_id}/cancel")
    @_openai_errors
    async def cancel_batch(batch_id: str):
        return service.cancel(batch_id)

    return router
