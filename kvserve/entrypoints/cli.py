"""`kvserve` command line: generate (one-shot or interactive chat), serve, run-batch, gateway, plan,
bench, eval, deploy."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import fields

from kvserve.argtypes import (
    at_most,
    finite_float,
    int_at_least,
    max_model_len,
    model_name,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    readable_file,
)
from kvserve.config import EngineConfig
from kvserve.entrypoints.chat_template_arg import chat_template
from kvserve.entrypoints.openai.root_path import root_path
from kvserve.entrypoints.openai.server_config import ServerConfig
from kvserve.entrypoints.serve_vllm_options import add_vllm_only_args
from kvserve.routing.registry import SERVE_POLICIES

# generate's bounds past any model: a model's own vocabulary and context are checked once it has
# loaded, seconds later; a typo of digits is refused at once
TOP_K = at_most(int_at_least(-1), 2**20, "past any model's vocabulary")
MAX_TOKENS = at_most(positive_int, 10**8, "past any model's context")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _vllm_dtype(text: str) -> str | None:
    """vLLM's spellings (auto: kvserve's default; float: float32), as LLM(dtype=...) takes them;
    float16 / half refused while parsing, not once serve's engine processes had started."""
    from kvserve.config import vllm_dtype

    try:
        return vllm_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("dtype: ")) from None


def _vllm_kv_cache_dtype(text: str) -> str:
    """vLLM's `--kv-cache-dtype fp8` (its most used spelling: e4m3 on CUDA) is kvserve's
    fp8_e4m3; it was refused once the engine processes had started. Another name is refused
    here, naming those kvserve runs (vLLM's fp8_e5m2 among them: kvserve's fp8 cache is e4m3)."""
    from kvserve.model.format_names import KV_CACHE_DTYPES

    value = text.strip().lower()
    value = "fp8_e4m3" if value == "fp8" else value
    if value not in KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not one of {', '.join(KV_CACHE_DTYPES)} (fp8: vLLM's name for fp8_e4m3)"
        )
    return value


def _engine_arg_types() -> dict[str, Callable[[str], object]]:
    """Flags checked as they are parsed: --data-parallel-size 100000 started that many engine
    processes (each with a share of the CPU threads, at least one) and never became ready.
    --max-model-len, --dtype and --kv-cache-dtype also take vLLM's spellings (4k, -1, auto, fp8)."""
    cpus = os.cpu_count() or 1
    replicas = at_most(positive_int, cpus, f"one engine process per CPU at most; this machine has {cpus}")
    return {
        "data_parallel_size": replicas, "max_model_len": max_model_len, "dtype": _vllm_dtype,
        "kv_cache_dtype": _vllm_kv_cache_dtype,
    }  # fmt: skip


# vLLM's short flags (`vllm serve MODEL -tp 2`), each "unrecognized arguments" before
VLLM_SHORT_FLAGS = {
    "tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp", "data_parallel_size": "-dp",
    "quantization": "-q",
}  # fmt: skip


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (--kv-cache-memory, --max-num-seqs, ...), and vLLM's
    short spellings of four."""
    checked = _engine_arg_types()
    g = p.add_argument_group("engine")
    for f in fields(EngineConfig):
        if f.name == "model":
            continue
        short = VLLM_SHORT_FLAGS.get(f.name)
        flags = ["--" + f.name.replace("_", "-"), *([short] if short else [])]
        if str(f.type) == "bool":  # --enable-x / --no-enable-x
            g.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                           help=f.metadata.get("help"))  # fmt: skip
            continue
        typ = checked.get(f.name) or {"int": int, "float": float}.get(str(f.type).split(" |")[0], str)
        g.add_argument(*flags, dest=f.name, type=typ, default=None, help=f.metadata.get("help"))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    kwargs = {
        f.name: getattr(args, f.name) for f in fields(EngineConfig) if getattr(args, f.name, None) is not None
    }
    return EngineConfig(**kwargs)


def _sampling(args: argparse.Namespace):
    from kvserve.sampling_params import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        stop=args.stop or None,
    )


def _stream(engine, request_id: str, prompt, params) -> str:
    """Run one request to completion, printing text as it is released."""
    engine.add_request(request_id, prompt, params)
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            delta = out.outputs[0].delta_text
            if delta:
                print(delta, end="", flush=True)
            text = out.outputs[0].text
    print()
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    from kvserve.engine.llm_engine import LLMEngine

    if not args.chat and not args.prompt:  # before the model loads: seconds, for nothing
        print("error: prompt: give a prompt, or --chat for a conversation", file=sys.stderr)
        return 2
    # each was silently dropped: --system without --chat, the prompt with it
    if args.system is not None and not args.chat:
        print("error: system: --system is for --chat (a plain prompt has no chat template)", file=sys.stderr)
        return 2
    if args.chat and args.prompt:
        print("error: prompt: --chat reads the conversation from stdin; drop the prompt", file=sys.stderr)
        return 2
    try:
        params = _sampling(args)
        engine = LLMEngine(engine_config(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = engine.tokenizer
    if not args.chat:
        try:
            _stream(engine, "0", args.prompt, params)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0

    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("kvserve chat — empty line or Ctrl-D to quit.", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        prompt = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        try:
            reply = _stream(engine, f"chat-{turn}", prompt, params)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})
        turn += 1


def _auth_error(args: argparse.Namespace) -> str | None:
    """Key settings that would leave the server more open than asked, each once silent: an
    empty --api-key (then 'Authorization: Bearer ' with nothing after it passed), a key for
    the naive baseline (which checks none), --metrics-require-key with no key to require."""
    if args.api_key and not all(args.api_key):
        return "api-key: must not be empty"
    if args.engine == "naive" and (args.api_key or args.metrics_require_key):
        return (
            "api-key: --engine naive (the transformers baseline) does not check keys; serve it locally only"
        )
    if args.metrics_require_key and not (args.api_key or os.environ.get("KVSERVE_API_KEY")):
        return "metrics-require-key: needs --api-key (or KVSERVE_API_KEY); /metrics would stay open"
    return None


def _batch_storage_error(args: argparse.Namespace) -> str | None:
    """The Batch API's folder and database, opened before the engine starts: one that could not
    be (a file, /proc/..., an unwritable home for the default) was found once the model had
    loaded, and the error left the engine running, so the command never exited."""
    import sqlite3

    from kvserve.batch.db import default_storage_dir, open_db

    storage = args.batch_storage_dir or default_storage_dir()
    try:
        open_db(storage).close()
    except (OSError, sqlite3.Error) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return f"batch-storage-dir: cannot keep the Batch API's files in {storage!r}: {why}"
    return None


# serve's flags that take several values: one given before the model takes the model too
_LIST_FLAGS = ("served_model_name", "allowed_origins", "allowed_methods", "allowed_headers")


def _swallowed_model(args: argparse.Namespace) -> str | None:
    """`kvserve serve --served-model-name foo ./model.gguf`: the list took the path as a second
    name, and the default model was served under both. Refused when no model was given and a
    list's last value is a file or folder, or a .gguf name."""
    if args.model is not None:
        return None
    for name in _LIST_FLAGS:
        last = (getattr(args, name) or [None])[-1]
        if last and (last.endswith(".gguf") or os.path.exists(os.path.expanduser(last))):
            flag = name.replace("_", "-")
            return (
                f"{flag}: {last!r} looks like the model, taken as a --{flag} value (the default model "
                f"would be served); give the model first: kvserve serve MODEL --{flag} ..."
            )
    return None


def _model_flag(args: argparse.Namespace) -> str | None:
    """vLLM's `--model X`, the older spelling of the positional MODEL its scripts still use (was
    "unrecognized arguments: --model"): taken as MODEL; both, naming two models, refused."""
    if args.model_flag is None:
        return None
    if args.model is not None and args.model != args.model_flag:
        return f"model: given twice, {args.model!r} and --model {args.model_flag!r}; give one"
    args.model = args.model_flag
    return None


def _same_path(a: str, b: str) -> bool:
    return a == b or os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def _vllm_only_options(args: argparse.Namespace) -> str | None:
    """vLLM's --tokenizer and --trust-remote-code, in the scripts users bring. --tokenizer naming
    the model is the model's own (so --engine naive takes it); kvserve runs no code from a model's
    repository, which --trust-remote-code is said not to change."""
    from kvserve.entrypoints.serve_vllm_options import vllm_only_problem

    problem = vllm_only_problem(args)
    if problem:
        return problem
    model = args.model or EngineConfig.model
    if args.tokenizer is not None and _same_path(args.tokenizer, model):
        args.tokenizer = None
    if args.trust_remote_code:
        logging.getLogger("kvserve.server").info(
            "trust-remote-code: accepted, and changes nothing: kvserve runs no code from a model's "
            "repository (it implements each architecture it serves)"
        )
    return None


def _tls_error(args: argparse.Namespace) -> str | None:
    """--ssl-keyfile / --ssl-certfile (vLLM's, uvicorn's TLS), loaded before the model: a key
    that does not match its certificate, or a key without one, stops the command at once."""
    import ssl

    if args.ssl_keyfile and not args.ssl_certfile:
        return "ssl-keyfile: needs --ssl-certfile (the certificate the key belongs to)"
    if not args.ssl_certfile:
        return None
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except (ssl.SSLError, OSError) as e:
        key = f" and --ssl-keyfile {args.ssl_keyfile!r}" if args.ssl_keyfile else ""
        return f"ssl-certfile: cannot serve TLS with {args.ssl_certfile!r}{key}: {e}"
    return None


def _naive_options(args: argparse.Namespace) -> str | None:
    """--engine naive given a flag it would drop (naive_options.py)."""
    if args.engine != "naive":
        return None
    from kvserve.entrypoints.naive_options import naive_problem

    return naive_problem(args, build_parser().parse_args(["serve"]))


def cmd_serve(args: argparse.Namespace) -> int:
    from kvserve.entrypoints.listen_check import listen_error

    problem = (
        _model_flag(args)
        or _vllm_only_options(args)
        or _swallowed_model(args)
        or _auth_error(args)
        or _tls_error(args)
        or _naive_options(args)
        or listen_error(args.host, args.port)
        or (None if args.engine == "naive" else _batch_storage_error(args))
    )
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    args.model = args.model or EngineConfig.model
    if args.engine == "naive":
        from kvserve.entrypoints.naive_server import serve_naive

        name = (args.served_model_name or [None])[0]
        return serve_naive(args.model, args.host, args.port, name, args.chat_template, args.uvicorn_log_level)
    from kvserve.engine.core_prespawn import PrespawnedCore, start_cores

    # The engine cores import torch and the engine, then load the model, while this process
    # imports the server's modules.
    cores = [PrespawnedCore() for _ in range(args.data_parallel_size or 1)]
    try:
        config = engine_config(args)
        start_cores(cores, config, args.routing_policy)
        from kvserve.entrypoints.openai.api_server import serve

        server = ServerConfig(
            served_model_name=args.served_model_name, api_keys=args.api_key or [],
            metrics_require_key=args.metrics_require_key, request_timeout=args.request_timeout,
            max_waiting_requests=args.max_waiting_requests, max_request_bytes=args.max_request_bytes,
            shutdown_timeout=args.shutdown_timeout,
            stream_stall_timeout=args.stream_stall_timeout if args.stream_stall_timeout > 0 else None,
            engine_restart_limit=args.engine_restart_limit, routing_policy=args.routing_policy,
            allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
            allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
            metrics_compat=args.metrics_compat, web_ui=not args.disable_web_ui,
            batch_storage_dir=args.batch_storage_dir,
            max_upload_size=args.max_upload_size, batch_window=args.batch_window,
            response_store=args.response_store,
            response_store_size=args.response_store_size, chat_template=args.chat_template,
            max_logprobs=args.max_logprobs,
            log_requests=not args.disable_log_requests, uvicorn_log_level=args.uvicorn_log_level,
            root_path=args.root_path, ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        )  # fmt: skip
        return serve(config, args.host, args.port, server, cores)
    except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as e:  # start-up problems
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug met starting the server (building its app): its stack, then one line
        logging.getLogger("kvserve.server").exception("the server could not start")
        print(f"error: the server could not start: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        for core in cores:
            core.cancel()


def cmd_gateway(args: argparse.Namespace) -> int:
    from kvserve.gateway.config import ConfigError, load_config

    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from kvserve.gateway.app import serve

    try:
        return serve(cfg, args.host, args.port, web_ui=not args.disable_web_ui)
    except ConfigError as e:  # found opening what the config names (database, state store)
        print(f"error: {e}", file=sys.stderr)
        return 2


def cmd_pd_proxy(args: argparse.Namespace) -> int:
    from kvserve.disagg.proxy import serve

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return serve(
            args.prefill, args.decode, args.host, args.port, args.max_request_bytes, args.prefill_timeout,
            args.decode_first_byte_timeout, args.shutdown_timeout,
        )  # fmt: skip
    except ValueError as e:  # a bad --prefill / --decode URL: one line, before anything starts
        print(f"error: {e}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve: LLM inference and serving")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate from a prompt, or chat interactively (--chat)")
    gen.add_argument("prompt", nargs="?", help="the prompt (omit with --chat)")
    gen.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or HF directory")
    gen.add_argument("--chat", action="store_true", help="interactive chat with the model's template")
    gen.add_argument("--system", default=None, help="system message for --chat")
    gen.add_argument("--max-tokens", type=MAX_TOKENS, default=256)
    gen.add_argument("--temperature", type=finite_float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=TOP_K, default=0, help="-1 or 0: off")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    srv.add_argument("model", nargs="?", default=None,
                     help="alias, .gguf file or HF directory (default smollm2-135m)")  # fmt: skip
    srv.add_argument("--model", dest="model_flag", metavar="MODEL", help="the model, as vLLM's --model")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=port, default=8000)
    srv.add_argument("--api-key", action="append", default=None,
                     help="require this bearer key (repeat for several; or set KVSERVE_API_KEY)")  # fmt: skip
    srv.add_argument("--metrics-require-key", action="store_true", help="/metrics needs an API key too")
    srv.add_argument("--served-model-name", nargs="+", type=model_name, default=None,
                     help="name(s) clients use, each listed and echoed back; the first names the model "
                          "in logs")  # fmt: skip
    srv.add_argument("--allowed-origins", nargs="*", default=[],
                     help="CORS: browser origins allowed to call the API ('*': any)")  # fmt: skip
    srv.add_argument("--allowed-methods", nargs="*", default=["*"], help="CORS: allowed methods")
    srv.add_argument("--allowed-headers", nargs="*", default=["*"], help="CORS: allowed request headers")
    srv.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies / auth headers")
    srv.add_argument("--response-store", default="memory",
                     help="Responses API store: memory | sqlite:PATH (survives restarts)")  # fmt: skip
    srv.add_argument("--response-store-size", type=positive_int, default=1024,
                     help="Responses API: stored responses kept (least recently used dropped)")  # fmt: skip
    srv.add_argument("--metrics-compat", choices=("vllm",), default=None,
                     help="also expose each kvserve:* series as vLLM's vllm:* (dashboards)")  # fmt: skip
    srv.add_argument(
        "--request-timeout", type=positive_float, default=None, help="seconds before a request is aborted"
    )
    srv.add_argument(
        "--max-waiting-requests", type=positive_int, default=None,
        help="past this many requests without a first token, answer 503 + Retry-After at once",
    )  # fmt: skip
    srv.add_argument("--max-request-bytes", type=positive_int, default=ServerConfig.max_request_bytes,
                     help="bodies larger than this get 413 before parsing (default 16 MiB)")  # fmt: skip
    srv.add_argument("--shutdown-timeout", type=non_negative_float, default=ServerConfig.shutdown_timeout,
                     help="on SIGTERM/SIGINT, seconds in-flight requests may take to finish")  # fmt: skip
    srv.add_argument("--stream-stall-timeout", type=non_negative_float,
                     default=ServerConfig.stream_stall_timeout,
                     help="abort a stream whose client has not read for this long (0: never)")  # fmt: skip
    srv.add_argument("--engine-restart-limit", type=non_negative_int,
                     default=ServerConfig.engine_restart_limit,
                     help="restart a dead engine core up to this many times in a row (0: never)")  # fmt: skip
    srv.add_argument("--routing-policy", choices=SERVE_POLICIES, default=ServerConfig.routing_policy,
                     help="how --data-parallel-size replicas share requests")  # fmt: skip
    srv.add_argument("--disable-web-ui", action="store_true", help="no chat at / and no /dashboard")
    srv.add_argument(
        "--batch-storage-dir",
        default=None,
        help="Batch API: files, outputs and job database (default $XDG_DATA_HOME/kvserve/batch)",
    )
    srv.add_argument(
        "--max-upload-size",
        type=positive_int,
        default=ServerConfig.max_upload_size,
        help="Batch API: largest file POST /v1/files accepts, in bytes (default 200 MiB)",
    )
    srv.add_argument(
        "--batch-window",
        type=positive_int,
        default=None,
        help="Batch API: a batch's requests in the engine at once (default --max-num-seqs)",
    )
    srv.add_argument("--chat-template", type=chat_template, default=None,
                     help="Jinja chat template used instead of the model's: a file, or the template "
                          "itself (as vLLM's)")  # fmt: skip
    srv.add_argument("--max-logprobs", type=int_at_least(-1), default=ServerConfig.max_logprobs,
                     help="as vLLM's: the most top alternatives (logprobs, top_logprobs, prompt_logprobs) "
                          "a request may ask for; -1: the vocabulary size (default 20)")  # fmt: skip
    srv.add_argument("--disable-log-requests", action="store_true", help="no log line per API request")
    srv.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS,
                     default=ServerConfig.uvicorn_log_level,
                     help="uvicorn's own log level (info: its access log too)")  # fmt: skip
    srv.add_argument("--root-path", type=root_path, default="",
                     help="as vLLM's: the URL prefix a reverse proxy serves the server under (/api/llm); "
                          "taken off request paths, kept or stripped by the proxy")  # fmt: skip
    srv.add_argument("--ssl-keyfile", type=readable_file, default=None, help="serve HTTPS: the TLS key")
    srv.add_argument("--ssl-certfile", type=readable_file, default=None,
                     help="serve HTTPS: the TLS certificate (chain) the key belongs to")  # fmt: skip
    srv.add_argument("--trust-remote-code", action="store_true",
                     help="accepted for vLLM's scripts; kvserve runs no code from a model's "
                          "repository")  # fmt: skip
    add_vllm_only_args(srv)
    srv.add_argument("--engine", choices=("kvserve", "naive"), default="kvserve",
                     help="naive: the transformers generate() baseline, one request at a time")  # fmt: skip
    add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)

    from kvserve.batch.offline import register as register_run_batch

    register_run_batch(sub, add_engine_args)

    gw = sub.add_parser("gateway", help="one OpenAI endpoint over many backends (keys, limits, budgets)")
    gw.add_argument("--config", required=True, help="gateway YAML (see docs/GATEWAY.md)")
    gw.add_argument("--host", default="127.0.0.1")
    gw.add_argument("--port", type=port, default=4000)
    gw.add_argument("--disable-web-ui", action="store_true", help="no chat at / and no /dashboard")
    gw.set_defaults(func=cmd_gateway)

    pd = sub.add_parser("pd-proxy", help="prefill on one engine, decode on another (docs/DISAGGREGATION.md)")
    pd.add_argument("--prefill", nargs="+", required=True, help="base URL(s) of kv_producer servers")
    pd.add_argument("--decode", nargs="+", required=True, help="base URL(s) of kv_consumer servers")
    pd.add_argument("--host", default="127.0.0.1")
    pd.add_argument("--port", type=port, default=8100)
    # both were taken as any number: -5 bytes made every request a 413, nan seconds failed every prefill
    pd.add_argument("--max-request-bytes", type=positive_int, default=16 * 2**20,
                    help="a larger request body is a 413 before it is read (default 16 MiB)")  # fmt: skip
    pd.add_argument(
        "--prefill-timeout",
        type=positive_float,
        default=60.0,
        help="seconds a prefill engine may take, then the decode engine computes the prompt",
    )
    pd.add_argument(
        "--decode-first-byte-timeout",
        type=positive_float,
        default=60.0,
        help="seconds a decode engine's stream may take to its first event (not a comment nor the role "
        "chunk), then the next decode engine is asked (as the gateway's first_byte_timeout)",
    )
    pd.add_argument("--shutdown-timeout", type=non_negative_float, default=30.0,
                    help="SIGTERM: seconds in-flight requests may finish; then streams get a shutting_down "
                    "error event and [DONE], waiting requests a 503 (as the gateway's)")  # fmt: skip
    pd.set_defaults(func=cmd_pd_proxy)

    from kvserve.planner.cli import register as register_plan

    register_plan(sub)
    from kvserve.bench.cli import register as register_bench

    register_bench(sub)
    from kvserve.eval.cli import register as register_eval

    register_eval(sub)
    from kvserve.deploy.cli import register as register_deploy

    register_deploy(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C while a command loads or runs: no traceback
        print("\ninterrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout's reader left (`kvserve plan ... --json | head`): stop as a shell tool does, with
        # no traceback, and no second one when the interpreter flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # 141: what a shell reports for a command ended by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
