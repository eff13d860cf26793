"""One upstream attempt. Nothing reaches the client until the backend has answered with a status
and (for streams) the answer's first event (an SSE comment such as `: ping` is not one, nor
chat's opening chunk with only the role; an error event is a failure), so every failure
before that can still be retried elsewhere; after it, the stream is passed through
event for event and a failure becomes an SSE error."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from kvserve.disagg.stream_start import ENGINE_GONE_CODES, REQUEST_ERROR_CODES
from kvserve.gateway.backends import BackendPool
from kvserve.gateway.config import Deployment
from kvserve.gateway.errors import backend_error
from kvserve.gateway.retries import CREDENTIALS_STATUS, is_context_error, is_retryable, parse_retry_after
from kvserve.gateway.sse import SSERelay
from kvserve.gateway.usage import normalized
from kvserve.routing.responses_ids import RESPONSES, public_body, public_error, public_event


@dataclass
class Outcome:
    """kind: ok | retry (try again, maybe elsewhere) | context (prompt too long there) |
    final (pass the backend's answer through, no retry)."""

    kind: str
    status: int
    content: bytes = b""
    media_type: str = "application/json"
    retry_after: float | None = None
    reason: str = ""
    usage: dict | None = None
    first_byte_s: float | None = None
    # streams only: the open upstream response, its byte iterator, the relay and first bytes
    response: httpx.Response | None = None
    chunks: AsyncIterator[bytes] | None = None
    relay: SSERelay | None = None
    first: bytes = b""
    extra: dict = field(default_factory=dict)
    # the backend itself answered with an error (a 500, or a stream whose first event is one):
    # maybe this request's doing, not the deployment's (handler.py decides whether it counts)
    answered_error: bool = False


def upstream_body(body: dict, dep: Deployment, stream: bool, path: str = "/chat/completions") -> bytes:
    out = dict(body, model=dep.backend.model)
    so = body.get("stream_options")
    # ask for usage to settle budgets and tpm (a Responses stream always ends with its usage, and
    # its stream_options has no include_usage). A value the backend would refuse (not a bool:
    # "yes", 1, null) goes as it came: overwritten, the client's mistake got a 200 without usage
    usage_asked = so.get("include_usage", False) if isinstance(so, dict) else False
    if (
        stream
        and path != RESPONSES
        and (so is None or isinstance(so, dict))
        and isinstance(usage_asked, bool)
    ):
        out["stream_options"] = {**(so or {}), "include_usage": True}  # (else the backend's 400)
    return json.dumps(out).encode()


async def attempt(
    pool: BackendPool, dep: Deployment, path: str, body: dict, stream: bool, client_wants_usage: bool,
    request_id: str | None = None,
) -> Outcome:  # fmt: skip
    """`request_id`: the X-Request-Id the backend gets (the one the client gets back)."""
    b = dep.backend
    client = pool.client(dep)
    headers = {**pool.headers(dep), **({"x-request-id": request_id} if request_id else {})}
    req = client.build_request(
        "POST", b.base_url + path, content=upstream_body(body, dep, stream, path), headers=headers
    )
    responses = path == RESPONSES
    t0 = time.monotonic()
    resp: httpx.Response | None = None
    reading_body = False
    # A stream must start within first_byte_timeout. A non-streamed answer's status line comes
    # with the finished answer from kvserve and vLLM, so only the total timeout bounds it (as
    # LiteLLM's `timeout`): a long generation is not cut off and retried, its work lost twice.
    first_byte = b.first_byte_timeout if stream else b.timeout
    try:
        async with asyncio.timeout(first_byte):
            resp = await client.send(req, stream=True)
            whole = resp.status_code >= 300 or not stream
            if not whole:
                rewrite = (lambda ev: public_event(ev, dep.id)) if responses else None
                relay = SSERelay(client_wants_usage or responses, rewrite)
                chunks = resp.aiter_raw()
                first = b""  # (comments and chat's opening chunk before it go out with it)
                while not relay.answered:  # a ping or a role is not an answer: timeout and retries apply
                    first += relay.feed(await chunks.__anext__())
                # the client has nothing yet: another can answer, unless every one would (the
                # request's own 400, streamed: passed on as a 4xx is)
                if relay.error_first is not None and relay.error_code not in REQUEST_ERROR_CODES:
                    await resp.aclose()
                    return Outcome(
                        "retry",
                        502,
                        reason=f"the stream began with an error ({relay.error_first})",
                        answered_error=relay.error_code not in ENGINE_GONE_CODES,  # (those: the deployment's)
                    )
        if whole:  # the rest of the body has the attempt's total timeout (the first byte came)
            reading_body = True
            async with asyncio.timeout(max(b.timeout - (time.monotonic() - t0), 0.001)):
                content = await resp.aread()
            await resp.aclose()
            out = _classify(resp, content, t0, path)
            if responses:  # the ids a follow-up names must lead back to this deployment
                out.content = (public_body if out.kind == "ok" else public_error)(out.content, dep.id, body)
            return out
        return Outcome(
            "ok",
            200,
            media_type="text/event-stream",
            first_byte_s=time.monotonic() - t0,
            response=resp,
            chunks=chunks,
            relay=relay,
            first=first,
        )
    except TimeoutError:
        reason, status = f"no first byte within {first_byte:g} s", 504
        if reading_body:
            reason = f"the answer did not end within the total timeout of {b.timeout:g} s"
    except httpx.ConnectError as e:
        reason, status = f"connect error ({e.__class__.__name__})", 503
    except httpx.TimeoutException as e:
        reason, status = f"timeout ({e.__class__.__name__})", 504
    except (httpx.HTTPError, StopAsyncIteration) as e:
        reason, status = f"upstream closed the connection ({e.__class__.__name__})", 502
    except BaseException:
        if resp is not None:
            await asyncio.shield(resp.aclose())
        raise
    if resp is not None:
        await resp.aclose()
    return Outcome("retry", status, reason=reason)


def _classify(resp: httpx.Response, content: bytes, t0: float, path: str) -> Outcome:
    status = resp.status_code
    media = resp.headers.get("content-type", "application/json")
    elapsed = time.monotonic() - t0
    if status < 300:
        try:
            answer = json.loads(content)
        except (ValueError, RecursionError):
            answer = None
        if not isinstance(answer, dict):  # (a proxy's HTML page, a truncated body): not an answer
            what = content[:80].decode("utf-8", "replace").strip() or "an empty body"
            return Outcome("retry", 502, reason=f"upstream answered {status} with no JSON object ({what!r})")
        usage = normalized(answer.get("usage"))
        return Outcome("ok", status, content, media, usage=usage, first_byte_s=elapsed)
    if is_retryable(status):
        retry_after = parse_retry_after(resp.headers.get("retry-after"))
        reason = f"upstream answered {status}"
        return Outcome("retry", status, content, media, retry_after, reason, answered_error=status == 500)
    if status in CREDENTIALS_STATUS:
        reason = f"upstream refused the deployment's api_key ({status} {_message(content)})"
        return Outcome("retry", status, content, media, reason=reason)
    if status == 404 and path != RESPONSES:  # (LiteLLM's rule too; a Responses 404 may be the request's)
        reason = f"upstream answered 404: the deployment's model or route is not there ({_message(content)})"
        return Outcome("retry", status, content, media, reason=reason)
    if is_context_error(status, content):
        return Outcome("context", status, content, media, reason="prompt longer than the backend's context")
    return Outcome("final", status, content, media, reason=f"upstream answered {status}")


def _message(content: bytes) -> str:
    """The backend's error message, short (for the gateway's own error and log)."""
    err = backend_error(content)
    msg = err["message"] if err is not None and "message" in err else content[:200].decode("utf-8", "replace")
    return str(msg)[:200]
