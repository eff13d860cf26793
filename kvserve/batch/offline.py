"""`kvserve run-batch -i in.jsonl -o out.jsonl`: the server's line runner without the server.

An engine core process and the chat/completion handlers run in this process; every line of
the input (OpenAI batch format) becomes one output line, results and errors alike, in the
order they finish. A tqdm bar shows progress; a summary is printed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time


def _endpoint_of(path: str) -> str:
    """The batch's endpoint: the url of its first line that names one (default chat)."""
    from kvserve.batch.jobs import ENDPOINTS

    with open(path, "rb") as f:
        for raw in f:
            try:
                url = json.loads(raw).get("url")
            except (ValueError, AttributeError):
                continue
            if url in ENDPOINTS:
                return url
    return ENDPOINTS[0]


async def _run(args: argparse.Namespace, config) -> int:
    from tqdm import tqdm

    from kvserve.batch.execute import execute_line
    from kvserve.batch.output import PlainSink
    from kvserve.batch.runner import LineRunner
    from kvserve.batch.validate import duplicate_errors, scan_input
    from kvserve.engine.async_llm import AsyncLLM
    from kvserve.entrypoints.openai.response_store import MemoryResponseStore
    from kvserve.entrypoints.openai.responses import ResponsesServing
    from kvserve.entrypoints.openai.serving import OpenAIServing

    scan = scan_input(args.input)
    if scan.duplicates:  # the output is matched to the input by custom_id alone
        for e in duplicate_errors(scan)["data"]:
            print(f"error: {e['message']}", file=sys.stderr)
        return 2
    total = scan.total
    endpoint = _endpoint_of(args.input)
    engine = AsyncLLM(config)
    if args.chat_template is not None:  # as serve's: every chat line renders with it
        engine.tokenizer.hf.chat_template = args.chat_template
    engine.start()
    names = [args.served_model_name or engine.source.name]
    serving = OpenAIServing(engine, names, None, max_logprobs=args.max_logprobs)
    responses = ResponsesServing(serving, MemoryResponseStore(1024))  # for lines with store: true
    t0 = time.monotonic()
    with tqdm(total=total, unit="req", desc="run-batch", disable=args.no_progress) as bar:
        sink = PlainSink(args.output, bar)
        try:

            async def execute(ep: str, body: dict, request_id: str):
                return await execute_line(serving, ep, body, request_id, responses)

            runner = LineRunner(
                endpoint, execute, sink, args.window or config.max_num_seqs, lambda: False, "run"
            )
            await runner.run(args.input)
        finally:
            sink.close()
            serving.close()
            engine.shutdown()
    took = time.monotonic() - t0
    print(
        f"run-batch: {sink.completed + sink.failed} lines ({sink.completed} ok, {sink.failed} errors) "
        f"in {took:.1f}s, {endpoint} -> {args.output}",
        file=sys.stderr,
    )
    return 0


def cmd_run_batch(args: argparse.Namespace) -> int:
    from kvserve.entrypoints.cli import engine_config
    from kvserve.entrypoints.serve_vllm_options import vllm_only_problem

    problem = vllm_only_problem(args)  # before the model loads
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        config = engine_config(args)
        return asyncio.run(_run(args, config))
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def register(sub, add_engine_args) -> None:
    # Checked while parsing, before the model loads: a missing input, an output in a missing
    # directory or a window below 1 ('Semaphore initial value must be >= 0') once surfaced after.
    from kvserve.argtypes import int_at_least, positive_int, readable_file, writable_file
    from kvserve.entrypoints.chat_template_arg import chat_template
    from kvserve.entrypoints.openai.limits import MAX_LOGPROBS
    from kvserve.entrypoints.serve_vllm_options import add_vllm_only_args

    p = sub.add_parser("run-batch", help="run an OpenAI batch file offline (no server)")
    p.add_argument(
        "-i", "--input", type=readable_file, required=True, help="input .jsonl (one request per line)"
    )
    p.add_argument(
        "-o", "--output", type=writable_file, required=True, help="output .jsonl (results and error lines)"
    )
    p.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or HF directory")
    p.add_argument("--served-model-name", default=None, help="the model name lines may use")
    p.add_argument(
        "--window",
        type=positive_int,
        default=None,
        help="requests in the engine at once (default max-num-seqs)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--max-logprobs", type=int_at_least(-1), default=MAX_LOGPROBS,
                   help="as serve's (vLLM's): the most top alternatives (logprobs, top_logprobs, "
                        "prompt_logprobs) a line may ask for; -1: the vocabulary (default 20)")  # fmt: skip
    # vLLM's run-batch takes its server's frontend flags: --chat-template as serve's, the rest as
    # serve takes them (each was "unrecognized arguments"); no request is logged offline
    p.add_argument("--chat-template", type=chat_template, default=None,
                   help="Jinja chat template chat lines render with instead of the model's: a file, or "
                        "the template itself (as serve's)")  # fmt: skip
    p.add_argument("--trust-remote-code", action="store_true", help="accepted; no model code runs here")
    p.add_argument("--disable-log-requests", action="store_true", help="accepted; run-batch logs no request")
    add_vllm_only_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_run_batch)
