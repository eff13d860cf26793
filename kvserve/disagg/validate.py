"""What the decode engine would refuse, refused before the prefill.

The prefill body leaves out or changes fields only the decode engine then checks
(split.prefill_body: stream_options, n, best_of, min_tokens, max_tokens,
max_completion_tokens, stream; logprobs and top_logprobs stay, for the prefill engine to
check against its --max-logprobs, which this process does not know). A bad value there was
prefilled and its KV leased for a decode that refused it, held until the producer's lease_s.
The body is checked here with kvserve serve's own request models, as its route does; only a
refusal naming one of those fields is answered here: any other field the prefill engine checks
itself. So are the output constraints (a schema, regex or grammar), left out of this check:
checking one takes seconds for a large schema, on this event loop, while the prefill engine
checks it anyway (on its serving pool)."""

from __future__ import annotations

from pydantic import ValidationError

from kvserve.disagg.errors import error
from kvserve.entrypoints.openai.compat import GUIDED
from kvserve.entrypoints.openai.echo_only import engine_max_tokens
from kvserve.entrypoints.openai.errors import field_path, param_of, specific_error
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

_UNCHECKED_BY_PREFILL = frozenset(
    {"stream_options", "n", "best_of", "min_tokens", "max_tokens", "max_completion_tokens", "stream"}
)  # fmt: skip
_CONSTRAINTS = frozenset({"response_format", "structured_outputs", *GUIDED})  # the prefill engine's to check


def decode_refusal(path: str, body: dict) -> dict | None:
    """The 400 body the decode engine would answer for a field the prefill does not check;
    None when it would not refuse one (or the path is neither chat nor completions)."""
    chat = path.endswith("/chat/completions")
    if not chat and not path.endswith("/completions"):
        return None
    body = {k: v for k, v in body.items() if k not in _CONSTRAINTS}
    try:
        if chat:
            req = ChatCompletionRequest.model_validate(body)
            if req.top_logprobs is not None and not req.logprobs:  # (as the chat route says it)
                raise ValueError("top_logprobs: requires logprobs=true")
            top = req.top_logprobs or 0
            req.sampling_params(req.max_completion_tokens or req.max_tokens, top if req.logprobs else None)
        else:
            req = CompletionRequest.model_validate(body)
            max_tokens = 16 if req.max_tokens is None else req.max_tokens
            # as the route: 0 with echo scores the prompt alone (an eval harness's request was a 400)
            req.sampling_params(engine_max_tokens(max_tokens, req.echo), req.logprobs)
    except ValidationError as e:
        first = specific_error(list(e.errors()))
        loc = list(first.get("loc", ()))
        param = str(loc[0]) if loc else None
        message = f"{field_path(loc)}: {first.get('msg', 'invalid value')}" if loc else str(e)
    except ValueError as e:
        message = str(e)
        param = param_of(message)
    except Exception:  # noqa: BLE001 - (a check of ours failing must not refuse a request)
        return None
    else:
        return None
    if param not in _UNCHECKED_BY_PREFILL:
        return None
    return error(message, param, code="invalid_value")
