"""vLLM's `vllm serve` options that change nothing in kvserve (or that kvserve cannot honour),
as `kvserve serve` flags. vLLM's own benchmark instructions start its server with
`--swap-space 16 --disable-log-requests`; each such flag was "unrecognized arguments". The
accepted values are the offline LLM's (llm_options.VLLM_LLM_ONLY) and serve's own tool-calling
flags (SERVE_ONLY): a value that changes nothing is taken, another refused before the model
loads, naming the flag and why."""

from __future__ import annotations

import argparse
from typing import Any

from kvserve.entrypoints.llm_options import _ANY, VLLM_LLM_ONLY

# on/off in vLLM's CLI; the rest take a value
_SWITCHES = (
    "disable_log_stats", "enable_chunked_prefill", "enable_auto_tool_choice", "enable_prompt_tokens_details",
    "enable_log_requests",
)  # fmt: skip
# vllm serve's own (not LLM(...)'s): vLLM's tool-calling servers start with
# `--enable-auto-tool-choice --tool-call-parser hermes`, "unrecognized arguments" here. kvserve
# always takes tool_choice auto and reads both formats below in whatever the model writes.
SERVE_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "enable_auto_tool_choice": ((None, True), "tool_choice auto is always available here"),
    "tool_call_parser": (
        (None, "hermes", "llama3_json"),
        "kvserve reads tool calls written as hermes' <tool_call>{...}</tool_call> or as llama3_json's "
        "bare JSON call (hermes, llama3_json)",
    ),
    # vLLM's model task: one server here answers /v1/chat/completions, /v1/completions and
    # /v1/embeddings (the last hidden state, pooled) for any model it loads
    "task": (
        (None, "auto", "generate", "embed", "embedding"),
        "kvserve serves generation and embeddings together (auto, generate, embed, embedding); it has no "
        "classification, scoring, reward or transcription models",
    ),
    "runner": (
        (None, "auto", "generate", "pooling"),
        "kvserve runs generate and pooling (embeddings) together",
    ),
    # what kvserve always does, in vLLM's serve commands (each was "unrecognized arguments")
    "response_role": ((None, "assistant"), "a chat reply's role is always assistant"),
    "enable_prompt_tokens_details": (
        (None, True),
        "usage always carries prompt_tokens_details (cached_tokens)",
    ),
    "enable_log_requests": ((None, True), "each API request is logged unless --disable-log-requests"),
    "max_log_len": ((_ANY,), ""),  # the request log line holds no prompt to shorten
    "guided_decoding_backend": ((None, "auto", "xgrammar"), "structured outputs compile with xgrammar"),
    "api_server_count": ((None, "1"), "a server runs one API process (scale out with --data-parallel-size)"),
    # no <think> splitting: a reasoning model's whole output, thinking included, is `content`
    "reasoning_parser": (
        (None,),
        "kvserve does not split a model's <think> text into reasoning_content (no reasoning parser); "
        "serve without it: the thinking stays in content",
    ),
}
# serve's own flag (--trust-remote-code, with its note), and one another change may add to serve
_OWN = ("trust_remote_code", "max_logprobs")


def _names() -> list[str]:
    return [name for name in VLLM_LLM_ONLY if name not in _OWN]


def vllm_only_names() -> list[str]:
    """The dests of the flags add_vllm_only_args adds."""
    return _names()


def _table() -> dict[str, tuple[tuple[Any, ...], str]]:
    return {**{name: VLLM_LLM_ONLY[name] for name in _names()}, **SERVE_ONLY}


def add_vllm_only_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM's options kvserve takes where they change nothing")
    for name, (accepted, why) in _table().items():
        flag = "--" + name.replace("_", "-")
        taken = [str(a) for a in accepted if a is not None]
        help_ = (
            "vLLM's; accepted, changes nothing here" if _ANY in accepted
            else f"vLLM's; only {' / '.join(taken)}: {why}" if taken
            else f"vLLM's; refused: {why}"
        )  # fmt: skip
        if name in _SWITCHES:
            g.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            g.add_argument(flag, dest=name, default=None, help=help_)


def vllm_only_problem(args: argparse.Namespace) -> str | None:
    """The first of these flags given a value kvserve cannot honour, said as such; or None."""
    for name, (accepted, why) in _table().items():
        value = getattr(args, name, None)
        if value is not None and _ANY not in accepted and value not in accepted:
            shown = f"--no-{name.replace('_', '-')}" if value is False else repr(value)
            return f"{name.replace('_', '-')}: {shown} is not supported; {why}"
    return None
