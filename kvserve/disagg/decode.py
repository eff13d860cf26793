"""The decode half of a pd-proxy request: the decode engines are asked in turn until one
answers. A failure before the engine has sent anything (no connection, a 5xx, 408 or 429, a
connection lost before the first byte) costs only time: the next engine is asked, as the
gateway retries on another deployment. A stream is the engine's once its answer's first event
has come (stream_start.py: not a comment nor chat's opening role chunk), within
`first_byte_timeout` as the gateway's; a stream whose first event is an error is a failure
too. From then on a death mid-stream ends the stream as kvserve serve ends a failed one
(routing/stream_failure.py: an error event, then [DONE]), and so does the proxy's drain deadline
(routing/in_flight.py: code `shutting_down`). A Responses
request's answer carries ids naming the engine that stores it (`tag`: routing/responses_ids.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

import httpx
from fastapi.responses import JSONResponse, Response

from kvserve.disagg.errors import error, reason
from kvserve.disagg.split import JSON_HEADER, json_content
from kvserve.disagg.stream_start import REQUEST_ERROR_CODES, StreamStart
from kvserve.routing.in_flight import InFlight
from kvserve.routing.responses_ids import EventRewriter, public_body, public_error
from kvserve.routing.settled_stream import SettledStream
from kvserve.routing.stream_failure import count_events, failed_stream_end

logger = logging.getLogger("kvserve.disagg.proxy")


def _retryable(status: int) -> bool:
    return status >= 500 or status in (408, 429)


def _engine_message(content: bytes) -> str:
    """The engine's own error message (what the client would have read), short."""
    try:
        msg = json.loads(content)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = content.decode("utf-8", "replace")
    return str(msg)[:200]


async def _first_event(chunks: AsyncIterator[bytes], timeout: float) -> tuple[bytes, str | None]:
    """The stream's bytes up to its answer's first event, and that event's error if it is one
    another engine may not give (not the request's own: REQUEST_ERROR_CODES); TimeoutError past
    `timeout`, StopAsyncIteration if the stream ended before it."""
    start, first = StreamStart(), b""
    async with asyncio.timeout(timeout):
        while not start.answered:
            chunk = await anext(chunks)
            first += chunk
            start.feed(chunk)
    return first, None if start.code in REQUEST_ERROR_CODES else start.error


async def decode(
    client: httpx.AsyncClient, urls: list[str], path: str, body: dict, stream: bool, send_headers: dict,
    headers: dict, first_byte_timeout: float = 60.0, tag: Callable[[str], str] | None = None,
    in_flight: InFlight | None = None,
) -> Response:  # fmt: skip
    """The first answer of `urls` (in order) that is not a failure before its first byte; a
    502 naming each engine and its failure when none gives one, or 503 with their Retry-After
    when those that answered said busy (503 or 429) and the others could not be reached (an
    engine down says nothing against trying again: a 502 lost the busy one's Retry-After).
    With `tag` (a Responses request) the answer's ids name the engine `tag(url)`, so a
    follow-up finds it. `in_flight`: the proxy's drain, whose deadline ends a stream relayed."""
    failures: list[str] = []
    busy, answered_busy, retry_after = True, False, None
    payload, send_headers = json_content(body), {**send_headers, **JSON_HEADER}
    for url in urls:
        req = client.build_request("POST", url + path, content=payload, headers=send_headers)
        try:
            resp = await client.send(req, stream=True)
        except httpx.HTTPError as e:
            failures.append(f"{url}: {reason(e)}")
            busy = busy and isinstance(e, httpx.ConnectError)  # (down: neither busy nor broken)
            logger.warning("decode engine %s failed (%s)", url, reason(e))
            continue
        relaying = False
        try:
            if stream and resp.status_code == 200:
                chunks = resp.aiter_raw()
                try:  # a failure before it: another engine can answer
                    first, err = await _first_event(chunks, first_byte_timeout)
                except (TimeoutError, StopAsyncIteration) as e:
                    why = "the stream ended before its first event"
                    if isinstance(e, TimeoutError):
                        why = f"no first event within {first_byte_timeout:g} s"
                    failures.append(f"{url}: {why}")
                    busy = False
                    logger.warning("decode engine %s: %s", url, why)
                    continue
                if err is not None:
                    failures.append(f"{url}: the stream began with an error ({err})")
                    busy = False
                    logger.warning("decode engine %s: the stream began with an error (%s)", url, err)
                    continue
                relaying = True
                relay = _relay(resp, url, first, chunks, EventRewriter(tag(url)) if tag else None, in_flight)
                # closed however the response ends: a client gone before it started left the relay
                # never started, its `finally` never run, the decode request open until collected
                return SettledStream(relay, resp.aclose, media_type="text/event-stream", headers=headers)
            content = await resp.aread()
        except httpx.HTTPError as e:
            failures.append(f"{url}: lost before its first byte ({reason(e)})")
            busy = False
            logger.warning("decode engine %s failed before its first byte (%s)", url, reason(e))
            continue
        finally:
            if not relaying:  # (also when cancelled: the client left; the engine aborts)
                await asyncio.shield(resp.aclose())
        if _retryable(resp.status_code):
            failures.append(f"{url}: answered {resp.status_code} ({_engine_message(content)})")
            busy = busy and resp.status_code in (429, 503)
            answered_busy = answered_busy or resp.status_code in (429, 503)
            retry_after = resp.headers.get("retry-after") or retry_after
            logger.warning("decode engine %s answered %d", url, resp.status_code)
            continue
        if tag is not None:
            content = (public_body if resp.status_code == 200 else public_error)(content, tag(url), body)
        media = resp.headers.get("content-type", "application/json")
        return Response(content, status_code=resp.status_code, media_type=media, headers=headers)
    message = f"no decode engine could answer: {'; '.join(failures)}"
    busy = busy and answered_busy
    out = dict(headers, **({"retry-after": retry_after} if busy and retry_after else {}))
    return JSONResponse(error(message, None, "server_error", "upstream_error"), 503 if busy else 502, out)


async def _relay(
    resp: httpx.Response, url: str, first: bytes, chunks: AsyncIterator[bytes], ids: EventRewriter | None,
    in_flight: InFlight | None,
) -> AsyncIterator[bytes]:  # fmt: skip
    """The decode engine's stream; `ids` (a Responses stream) rewrites its ids event by event."""
    sent = 0  # a Responses stream's events passed on (its error event is numbered after them)
    in_flight = in_flight or InFlight()
    try:
        out = ids.feed(first) if ids else first
        if out:
            sent += count_events(out)
            yield out
        while True:
            async with in_flight.read():  # (the drain's deadline ends a read waiting)
                chunk = await anext(chunks, None)
            if chunk is None:
                break
            out = ids.feed(chunk) if ids else chunk
            if out:  # (a Responses event not yet whole waits for its end)
                sent += count_events(out)
                yield out
        if ids is not None and (out := ids.flush()):
            yield out
    except httpx.HTTPError as e:  # the decode engine died mid-stream: an error event, not a cut
        logger.warning("decode engine %s failed mid-stream (%s)", url, reason(e))
        message = f"decode engine {url} failed mid-stream ({reason(e)}); the answer is incomplete"
        yield failed_stream_end(message, ids is not None, sent)
    except TimeoutError:  # the drain's deadline (only it times a read out here)
        yield failed_stream_end(f"{in_flight.message}; the answer is incomplete", ids is not None, sent,
                                "shutting_down")  # fmt: skip
    finally:
        await resp.aclose()  # the client left (or the stream ended): the decode engine aborts
