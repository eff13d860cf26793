"""Which `kvserve serve` flags `--engine naive` (the transformers generate() baseline) honours.
Every other one was dropped unsaid: `--engine naive --chat-template T --max-model-len 512` served
with the model's own template and context. A flag the baseline cannot honour is refused before
the model loads, naming it."""

from __future__ import annotations

import argparse

from kvserve.entrypoints.serve_vllm_options import vllm_only_names

# what serve_naive uses (--tokenizer naming the model itself is dropped before, another is
# refused here: the baseline loads the model's own); --trust-remote-code is logged before;
# --disable-log-requests and --disable-web-ui: the baseline logs no request and has no web UI,
# so they hold already; --api-key and --metrics-require-key have their own message
HONOURED = frozenset(
    ("model", "model_flag", "host", "port", "engine", "served_model_name", "chat_template",
     "uvicorn_log_level", "trust_remote_code", "disable_log_requests", "disable_web_ui",
     "api_key", "metrics_require_key", "command", "func")
)  # fmt: skip


def naive_problem(args: argparse.Namespace, defaults: argparse.Namespace) -> str | None:
    """The first flag given a value `--engine naive` would ignore, said as such; or None.
    `defaults`: serve's own defaults (the flags' values when none is given)."""
    if args.engine != "naive":
        return None
    if len(args.served_model_name or []) > 1:
        return "served-model-name: --engine naive serves the model under one name; give one"
    no_ops = set(vllm_only_names())  # vLLM's options that change nothing in either engine
    for name, value in vars(args).items():
        if name in HONOURED or name in no_ops or value == getattr(defaults, name, None):
            continue
        flag = name.replace("_", "-")
        return (
            f"{flag}: not used by --engine naive (the transformers generate() baseline: the model in "
            f"float32, one request at a time, with transformers' own settings); drop --{flag}"
        )
    return None
