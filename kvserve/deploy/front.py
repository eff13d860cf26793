"""The front of the Ray Serve application: Serve's HTTP proxy hands every request to this
small FastAPI ingress (no engine), which passes it to the kvserve replicas through a
DeploymentHandle, so the replicas' request router (ray_router.py: kvserve's routing policy)
picks which one. Responses stream through chunk by chunk, status and content type as the
replica's server answered, with `x-kvserve-replica` naming the replica. A stored Responses
answer lives on its replica only: its id names the replica (routing/responses_ids.py), and
previous_response_id (of a create or an input_tokens count), GET and DELETE go there (`pin`),
as the gateway sends them to a deployment.
"""

import json
import logging
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.deploy.replica import FORWARDED_HEADERS
from kvserve.entrypoints.openai.middleware import HeadAsGet
from kvserve.routing.json_type import not_json
from kvserve.routing.responses_ids import decode_id, previous_id_problem
from kvserve.routing.stream_failure import count_events, failed_stream_end

logger = logging.getLogger("kvserve.deploy.front")
app = FastAPI(title="kvserve on Ray Serve")
app.add_middleware(HeadAsGet)  # monitors probe /health with HEAD (was a 405: taken out as down)


def _error(
    status: int, message: str, code: str, param: str | None = None, type_: str = "invalid_request_error"
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status
    )


def _reason(e: BaseException) -> str:
    """The failure, short: a replica's exception reaches the front wrapped in Ray's RayTaskError,
    whose text is the actor's traceback header (terminal colours, actor ids); its cause says it."""
    cause = getattr(e, "cause", None)
    e = cause if isinstance(cause, BaseException) else e
    return f"{e.__class__.__name__}: {e}".strip(": ")[:300]


def _replica_failed(e: Exception) -> JSONResponse:
    """A replica that failed before it answered (its server died, Serve lost the actor): a 502
    in OpenAI's shape, where it was Serve's text/plain 500 and a traceback."""
    logger.warning("a replica failed before answering (%s)", _reason(e))
    return _error(502, f"the replica failed before answering ({_reason(e)})", "upstream_error",
                  type_="server_error")  # fmt: skip


def _not_made_here(public_id: object, param: str | None) -> JSONResponse:
    what = "previous_response_id: response" if param else "response"
    msg = f"{what} {str(public_id)[:200]!r} not found (not made through this deployment)"
    return _error(400 if param else 404, msg, "previous_response_not_found" if param else "not_found", param)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
    """An unknown path or method: OpenAI's shape (was FastAPI's {"detail": ...})."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "invalid_request")
    err = _error(e.status_code, f"{e.detail}: {request.method} {request.url.path}", code)
    for k, v in (getattr(e, "headers", None) or {}).items():  # (a 405's Allow)
        err.headers[k] = v
    return err


async def _body(request: Request, limit: int) -> bytes | None:
    """The body, or None past `limit` bytes (a declared length is refused before reading)."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


_BATCH_METHODS = ["GET", "POST", "DELETE"]
# the POSTs whose previous_response_id goes to the replica it names: create, and counting a prompt
_PINNED = ("/v1/responses", "/v1/responses/input_tokens")


def _headers(request: Request) -> dict[str, str]:
    return {k: request.headers[k] for k in FORWARDED_HEADERS if k in request.headers}


@serve.ingress(app)
class Front:
    def __init__(self, replicas: DeploymentHandle, max_request_bytes: int = 16 * 2**20) -> None:
        self.replicas = replicas
        self.max_request_bytes = max_request_bytes

    @app.api_route("/v1/files", methods=_BATCH_METHODS, include_in_schema=False)
    @app.api_route("/v1/files/{rest:path}", methods=_BATCH_METHODS, include_in_schema=False)
    @app.api_route("/v1/batches", methods=_BATCH_METHODS, include_in_schema=False)
    @app.api_route("/v1/batches/{rest:path}", methods=_BATCH_METHODS, include_in_schema=False)
    async def batch_api(self, request: Request) -> Response:  # (before the catch-all POST route)
        """The Batch API is not routed to the replicas: a file and the batch reading it live on
        one replica, and Serve replaces and removes replicas with their files (a batch id would
        outlive its replica). POST /v1/files was taken by the catch-all route as a generation
        (400 "not valid JSON" for its multipart upload) and GET /v1/batches was a 405; both read
        as a broken deployment. Now a 404 saying where batches go."""
        msg = (f"{request.url.path}: this Ray Serve deployment does not route the Batch API "
               "(/v1/files, /v1/batches); run batch jobs on a kvserve serve instance, or offline with "
               "`kvserve run-batch` (docs/DEPLOYMENT.md)")  # fmt: skip
        return _error(404, msg, "unsupported_endpoint")

    @app.post("/v1/responses/{response_id}/cancel")  # (before the catch-all POST route below)
    async def cancel(self, response_id: str, request: Request) -> Response:
        """OpenAI's responses.cancel, on the replica its id names (the catch-all route took it
        as a generation: a 400 for its empty body)."""
        return await self._stored(response_id, request, "/cancel")

    @app.post("/v1/{path:path}")
    async def post(self, path: str, request: Request) -> Response:
        return await self._relay(f"/v1/{path}", request)

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        """kvserve serve's /tokenize on a replica (a 404 through the front: the gateway counts a
        deployment's prompt tokens with it, and fell back to estimates)."""
        return await self._relay("/tokenize", request)

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        return await self._relay("/detokenize", request)

    @app.get("/version")
    async def version(self, request: Request) -> Response:
        return await self._get("/version", request)

    @app.get("/ping")  # vLLM's (and SageMaker's) name for liveness, as kvserve serve answers it
    @app.post("/ping")
    async def ping(self, request: Request) -> Response:
        return await self._get("/health", request)

    async def _relay(self, target: str, request: Request) -> Response:
        """A POST with a JSON body to `target` on a replica, its answer passed through."""
        if (why := not_json(request.headers.get("content-type"))) is not None:  # (curl -d: a form's)
            return _error(400, why, "invalid_json")
        raw = await _body(request, self.max_request_bytes)
        if raw is None:  # (was read whole, however large: one upload took the front's memory)
            msg = f"request body is larger than the deployment's limit of {self.max_request_bytes} bytes"
            return _error(413, msg, "request_too_large")
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "the body is not valid JSON", "invalid_json")
        except RecursionError:  # the client's mistake too: a 400, not a 500 and a traceback
            return _error(400, "the body is not valid JSON (nested too deeply)", "invalid_json")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "invalid_json")
        pin = None
        responses = target == "/v1/responses"
        pinned = target in _PINNED  # (input_tokens went to any replica with the public id: not found)
        if pinned and (wrong := previous_id_problem(body.get("previous_response_id"))):
            return _error(400, wrong, "invalid_value", "previous_response_id")  # (was "not found")
        if pinned and body.get("previous_response_id") is not None:
            where = decode_id(body["previous_response_id"])
            if where is None:
                return _not_made_here(body["previous_response_id"], "previous_response_id")
            pin, body = where[0], dict(body, previous_response_id=where[1])
        gen = self.replicas.options(stream=True).forward.remote(target, body, _headers(request), pin=pin)
        try:
            meta = await gen.__anext__()
        except Exception as e:
            return _replica_failed(e)
        sse = meta["content_type"].startswith("text/event-stream")

        async def rest():
            sent = 0  # events passed on (a Responses error event is numbered after them)
            try:
                async for chunk in gen:
                    sent += count_events(chunk)
                    yield chunk
            except Exception as e:  # (the stream was cut with no word: the client read a short answer)
                if not sse:
                    raise  # a JSON body cut short: the connection is broken off, not ended
                logger.warning("a replica failed mid-stream (%s)", _reason(e))
                # as kvserve serve ends a failed stream: an error event, then [DONE] (was none:
                # clients reading to [DONE] waited), or a Responses stream's own error event
                message = f"the replica failed mid-stream ({_reason(e)}); the answer is incomplete"
                yield failed_stream_end(message, responses, sent)

        return StreamingResponse(
            rest(), status_code=meta["status"], media_type=meta["content_type"],
            headers={**meta.get("headers", {}), "x-kvserve-replica": meta["replica"]},  # (was the id alone)
        )  # fmt: skip

    @app.get("/v1/responses/{response_id}")
    @app.delete("/v1/responses/{response_id}")
    async def stored(self, response_id: str, request: Request) -> Response:
        """A stored response, on the replica that answered it (its id names it)."""
        return await self._stored(response_id, request, "")

    async def _stored(self, response_id: str, request: Request, tail: str) -> Response:
        where = decode_id(response_id)
        if where is None:
            return _not_made_here(response_id, None)
        call = self.replicas.stored.remote(request.method, where[1], request.url.query, _headers(request),
                                           pin=where[0], tail=tail)  # fmt: skip
        try:
            status, media_type, content = await call
        except Exception as e:
            return _replica_failed(e)
        return Response(
            content, status_code=status, media_type=media_type, headers={"x-kvserve-replica": where[0]}
        )

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(self, response_id: str, request: Request) -> Response:
        return await self._stored(response_id, request, "/input_items")

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        return await self._get("/v1/models", request)

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> Response:
        """OpenAI's models.retrieve (was a 405: only POST matched the path)."""
        return await self._get(quote(request.url.path), request)

    @app.get("/health")
    async def health(self, request: Request) -> Response:
        """Liveness of a replica (any: Serve replaces dead ones itself)."""
        return await self._get("/health", request)

    @app.get("/health/ready")
    async def ready(self, request: Request) -> Response:
        return await self._get("/health/ready", request)

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """No Prometheus page here: one replica's would pass for the deployment's. Ray exports
        Serve's metrics itself (was the generic 404 "Not Found", which read as a broken route)."""
        msg = ("/metrics: a Ray Serve deployment's metrics are Ray's: Serve's ray_serve_* series (requests, "
               "latency, queued and ongoing requests, replicas, per deployment and replica) on each Ray "
               "node's metrics export port (`ray start --metrics-export-port`), listed for Prometheus in "
               "/tmp/ray/prom_metrics_service_discovery.json on the head node; the replicas' own kvserve "
               "metrics are not exported (docs/DEPLOYMENT.md)")  # fmt: skip
        return _error(404, msg, "unsupported_endpoint")

    async def _get(self, path: str, request: Request) -> Response:
        try:
            status, media_type, content = await self.replicas.get.remote(path, _headers(request))
        except Exception as e:
            return _replica_failed(e)
        return Response(content, status_code=status, media_type=media_type)
