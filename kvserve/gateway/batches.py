"""The Batch API (/v1/files, /v1/batches) through the gateway, as LiteLLM's proxy routes it.

An upload goes to one deployment of the alias its lines name (batch_lines.py); the file's id,
and the ids of the batch made from it and of that batch's output files, name that deployment
and the key that made them (batch_ids.py), so retrieve, cancel and content reach the backend
holding them, from any gateway instance, and only for that key (or the master key). A backend's
own list shows every caller's files, so the lists are the key's own: the ids it made, kept in
the state store.

A batch runs outside the gateway's per-request admission (its lines run on the backend): its
usage is charged to the key that created it once it has finished (batch_spend.py), and a key or
team with a tpm limit may upload files but not create batches (its per-minute window cannot
count a batch's tokens): a 403 saying so."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any
from urllib.parse import quote

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import UploadFile

from kvserve.gateway.batch_ids import BATCH, FILE, Held, decode, encode, owner_tag
from kvserve.gateway.batch_lines import file_alias, for_backend, public_lines
from kvserve.gateway.batch_spend import BatchSpend
from kvserve.gateway.client_params import DROPPED
from kvserve.gateway.config import Deployment
from kvserve.gateway.errors import GatewayError
from kvserve.gateway.handler import Gateway
from kvserve.gateway.json_type import require_json
from kvserve.gateway.keys import KeyRecord, KeyStore

_FILE_FIELDS = ("input_file_id", "output_file_id", "error_file_id")
_LIST_TTL = 30 * 86400.0  # a key's list of ids outlives any batch (24 h window) and its files
_LIST_MAX = 10_000
_LIST_FETCH = 32  # objects a list asks the backends for at a time
_WHAT = {FILE: "file", BATCH: "batch"}
_FORM_FIELDS = ("purpose", "expires_after")  # an upload's fields passed on (expires_after[...])
# batches.create's body fields of LiteLLM's clients (extra_body): a hosted backend refuses them
_LITELLM_FIELDS = frozenset({"custom_llm_provider", "target_model_names", *DROPPED})

# A malformed upload is the client's mistake and gets its 400 (Starlette's MultiPartException):
# the WARNING python_multipart logs for it too was noise an operator cannot act on. Its errors stay.
logging.getLogger("python_multipart").setLevel(logging.ERROR)


def _bucket(prefix: str, owner: str) -> str:
    return f"batchapi:{_WHAT[prefix]}:{owner}"


class BatchAPI:
    """The routes' work, over the gateway's deployments, pool and state store."""

    def __init__(self, gateway: Gateway, keys: KeyStore) -> None:
        self.gw = gateway
        self.spend = BatchSpend(gateway, keys)

    # ---- what an id names, for this key ------------------------------------------------------
    def _held(
        self, key: KeyRecord, prefix: str, public_id: str, param: str | None = None
    ) -> tuple[Deployment, Held]:
        held = decode(prefix, public_id)
        dep = self.gw.router.by_id.get(held.deployment) if held else None
        mine = held is not None and (key.source == "master" or held.owner == owner_tag(key.account))
        if dep is None or not mine or dep.model_name not in self.gw.allowed_models(key):
            what = _WHAT[prefix]  # (another key's: not said to exist)
            raise GatewayError(
                404, f"No such {what}: {public_id[:200]!r} (not made through this gateway with this key, "
                "or its deployment is no longer configured)", code="not_found", param=param,
            )  # fmt: skip
        return dep, held

    async def _call(
        self, dep: Deployment, method: str, path: str, stream: bool = False, **kw: Any
    ) -> httpx.Response:
        """The backend's answer (`stream`: its body not read yet)."""
        b = dep.backend
        headers = {k: v for k, v in self.gw.pool.headers(dep).items() if k != "content-type"}
        timeout = httpx.Timeout(b.timeout, connect=b.connect_timeout, read=b.idle_timeout)
        client = self.gw.pool.client(dep)
        try:
            req = client.build_request(method, b.base_url + path, headers=headers, timeout=timeout, **kw)
            return await client.send(req, stream=stream)
        except httpx.HTTPError as e:
            raise GatewayError(
                502,
                f"deployment {dep.id} did not answer ({e.__class__.__name__})",
                "server_error",
                "upstream_error",
            ) from None

    def _public(
        self, r: httpx.Response, dep: Deployment, owner: str, public_id: str | None = None
    ) -> Response:
        """The backend's answer with the gateway's ids; its 404 names the id the client sent."""
        head = {"x-kvserve-deployment": dep.id}
        if r.status_code == 404 and public_id is not None:
            err = {"message": f"No such object: {public_id[:200]!r}", "type": "invalid_request_error",
                   "param": None, "code": "not_found"}  # fmt: skip
            return JSONResponse({"error": err}, 404, headers=head)
        try:
            obj = r.json() if r.status_code == 200 else None
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            media = r.headers.get("content-type", "application/json")
            return Response(r.content, r.status_code, media_type=media, headers=head)
        return JSONResponse(self._rewrite(obj, dep, owner), headers=head)

    def _rewrite(self, obj: dict, dep: Deployment, owner: str) -> dict:
        kind = obj.get("object")
        if isinstance(obj.get("id"), str) and kind in ("file", "batch"):
            obj["id"] = encode(FILE if kind == "file" else BATCH, dep.id, owner, obj["id"])
        if kind == "batch":
            for f in _FILE_FIELDS:
                if isinstance(obj.get(f), str) and obj[f]:
                    obj[f] = encode(FILE, dep.id, owner, obj[f])
            if obj.get("model") == dep.backend.model:
                obj["model"] = dep.model_name  # the alias the client's lines named
        return obj

    async def _remember(self, prefix: str, owner: str, public_id: str) -> None:
        await self.gw.store.cache_add(_bucket(prefix, owner), public_id.encode(), _LIST_TTL, _LIST_MAX)

    # ---- files -------------------------------------------------------------------------------
    async def upload(self, key: KeyRecord, request: Request) -> Response:
        form = await request.form()
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            got = "missing" if purpose is None else f"got {str(purpose)[:100]!r}"
            raise GatewayError(400, f"purpose: must be 'batch' ({got})", param="purpose")
        if not isinstance(upload, UploadFile):
            raise GatewayError(400, "file: missing (a multipart file field)", param="file")
        data = await upload.read()
        # parsed in a thread: a 16 MiB file's lines held the event loop (every stream) ~0.5 s
        alias = await asyncio.to_thread(file_alias, data, self.gw.allowed_models(key))
        # OpenAI's own fields only: LiteLLM's clients add theirs (custom_llm_provider,
        # target_model_names), which a hosted backend may refuse as unknown
        fields = {k: v for k, v in form.items() if isinstance(v, str) and k.partition("[")[0] in _FORM_FIELDS}
        name = upload.filename or "batch.jsonl"
        tried: set[str] = set()
        failures: list[str] = []
        # the group's deployments in turn until one takes the file: one that is down, failing
        # (5xx) or without the Batch API (404 / 405) is skipped, as a request's attempt would be
        while (dep := await self.gw.router.pick(alias, tried, tried)) is not None:
            tried.add(dep.id)
            lines = await asyncio.to_thread(for_backend, data, dep.backend.model)
            files = {"file": (name, lines, "application/jsonl")}
            try:
                r = await self._call(dep, "POST", "/files", data=fields, files=files)
            except GatewayError as e:
                failures.append(str(e))
                continue
            if r.status_code >= 500 or r.status_code in (404, 405):
                failures.append(f"deployment {dep.id} answered POST /files {r.status_code}")
                continue
            owner = owner_tag(key.account)
            resp = self._public(r, dep, owner)
            if r.status_code == 200:
                await self._remember(FILE, owner, json.loads(resp.body)["id"])
            return resp
        why = "; ".join(failures) or "every deployment is cooling down"
        raise GatewayError(503, f"model {alias!r}: no deployment took the file ({why})", "server_error",
                           "no_deployment")  # fmt: skip

    async def file(self, key: KeyRecord, method: str, public_id: str, tail: str = "") -> Response:
        """GET a file, GET its content (`tail` "/content"), or DELETE it."""
        dep, held = self._held(key, FILE, public_id)
        path = f"/files/{quote(held.backend_id, safe='')}"
        if tail:
            return await self._content(dep, path + tail, public_id, held.owner)
        r = await self._call(dep, method, path)
        resp = self._public(r, dep, held.owner, public_id)
        if method == "DELETE" and r.status_code == 200:  # (its answer is {"id", "object": "file", ...})
            return JSONResponse(
                dict(json.loads(resp.body), id=public_id), headers={"x-kvserve-deployment": dep.id}
            )
        return resp

    async def _content(self, dep: Deployment, path: str, public_id: str, owner: str) -> Response:
        """A file's bytes as they come (an output file can be hundreds of MB: not held whole)."""
        r = await self._call(dep, "GET", path, stream=True)
        if r.status_code != 200:
            await r.aread()
            await r.aclose()
            return self._public(r, dep, owner, public_id)

        async def body():
            rest = b""  # a line not yet ended
            public = None  # the lines' rewrite, by the first (batch_lines.py)
            try:
                async for chunk in r.aiter_bytes():
                    *lines, rest = (rest + chunk).split(b"\n")
                    if lines:
                        public = public or public_lines(lines[0], dep.id, dep.backend.model, dep.model_name)
                        yield b"".join(public(x) + b"\n" for x in lines)
                if rest:
                    public = public or public_lines(rest, dep.id, dep.backend.model, dep.model_name)
                    yield public(rest)
            finally:
                await r.aclose()

        media = r.headers.get("content-type", "application/octet-stream")
        return StreamingResponse(body(), media_type=media, headers={"x-kvserve-deployment": dep.id})

    # ---- batches -----------------------------------------------------------------------------
    async def _may_batch(self, key: KeyRecord) -> None:
        team = self.gw.cfg.teams.get(key.spec.team or "")
        for who, limits in (("key", key.spec), ("team", team), ("user", key.owner)):
            if limits is not None and limits.tpm is not None:
                raise GatewayError(
                    403,
                    f"this {who} has a tpm limit; a batch's tokens cannot be counted in a per-minute "
                    "window, so keys with a tpm limit cannot create batches (docs/GATEWAY.md)",
                    code="batch_not_allowed",
                )
        await self.spend.may_create(key)  # a budget already spent

    async def create(self, key: KeyRecord, request: Request) -> Response:
        require_json(request)
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError):
            raise GatewayError(400, "the body is not valid JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise GatewayError(400, "the body must be a JSON object", code="invalid_json")
        if not isinstance(body.get("input_file_id"), str):
            raise GatewayError(400, "input_file_id: required (a file id)", param="input_file_id")
        dep, held = self._held(key, FILE, body["input_file_id"], "input_file_id")
        await self._may_batch(key)
        litellms = [k for k in body if k in _LITELLM_FIELDS or k.startswith("user_api_key_")]
        body = {k: v for k, v in body.items() if k not in litellms}
        body["input_file_id"] = held.backend_id
        r = await self._call(dep, "POST", "/batches", json=body)
        resp = self._public(r, dep, held.owner)
        if r.status_code == 200:
            public_id = json.loads(resp.body)["id"]
            await self.spend.created(key, public_id)
            await self._remember(BATCH, held.owner, public_id)
        return resp

    async def batch(self, key: KeyRecord, method: str, public_id: str, tail: str = "") -> Response:
        """GET a batch, or POST its cancel (`tail` "/cancel")."""
        dep, held = self._held(key, BATCH, public_id)
        r = await self._call(dep, method, f"/batches/{quote(held.backend_id, safe='')}{tail}")
        resp = self._public(r, dep, held.owner, public_id)
        if r.status_code == 200 and isinstance(resp, JSONResponse):  # finished: charged, outputs listed
            for file_id in await self.spend.seen(dep, json.loads(resp.body), public_id):
                await self._remember(FILE, held.owner, file_id)
        return resp

    # ---- lists: the key's own ids, newest first ----------------------------------------------
    async def listing(
        self, key: KeyRecord, prefix: str, limit: int, after: str | None, purpose: str | None = None,
        ascending: bool = False,
    ) -> dict:  # fmt: skip
        """`purpose`, `ascending`: files.list's `purpose` and `order=asc` (OpenAI's, kvserve serve's)."""
        most = 10_000 if prefix == FILE else 100
        if not 1 <= limit <= most:
            raise GatewayError(400, f"limit: must be between 1 and {most}, got {limit}", param="limit")
        ids = [e.decode() for e in await self.gw.store.cache_entries(_bucket(prefix, owner_tag(key.account)))]
        ids = list(dict.fromkeys(ids))
        if ascending:
            ids.reverse()
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        rows: list[dict] = []
        while ids and len(rows) <= limit:  # one more than the page, to tell has_more
            n = min(_LIST_FETCH, limit + 1 - len(rows))  # (a 10,000-file page: not 10,000 at once)
            chunk, ids = ids[:n], ids[n:]
            got = await asyncio.gather(*(self._row(key, prefix, i) for i in chunk))
            rows += [g for g in got if g is not None and purpose in (None, g.get("purpose"))]
        page = rows[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(rows) > limit}  # fmt: skip

    async def _row(self, key: KeyRecord, prefix: str, public_id: str) -> dict | None:
        """One listed object, or None when it is gone (deleted, expired, deployment removed)."""
        try:
            resp = await (
                self.file(key, "GET", public_id) if prefix == FILE else self.batch(key, "GET", public_id)
            )
        except GatewayError:
            return None
        return json.loads(resp.body) if resp.status_code == 200 else None
