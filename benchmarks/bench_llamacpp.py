"""Optional side by side (issue 16): llama.cpp serving the same GGUF, against `kvserve serve`.

All servers run the default model's GGUF (SmolLM2-135M-Instruct, Q4_1) on this machine's
threads and are driven by `kvserve bench serve` in its own process, as bench_cpu_serve.py
drives kvserve alone: c=1 (`--c1-requests` streamed completions one at a time) and c=32
(`--requests` of ~100-token prompts x 128 output tokens, at most 32 in flight).
- `--llama-python`: llama-cpp-python's OpenAI server (what the issue names), which decodes
  one request at a time (`--interrupt_requests False`: its default drops the streaming
  request when another arrives);
- `--llama-server`: llama.cpp's own C++ server, 32 slots batched continuously;
- kvserve: each `--configs` configuration (bench_cpu_serve.py's names; the default is what
  `make serve` runs).
Beside the servers, each engine's own decode time per token in one process: llama.cpp's
`Llama.eval` one token at a time, kvserve's offline `LLM` (bench_cpu_serve.py's yardstick).
Output lengths are fixed everywhere: kvserve takes `ignore_eos`, llama.cpp gets a -100 logit
bias on the model's end tokens.

Neither is ever a dependency of kvserve: install llama-cpp-python in its own environment
(`pip install "llama-cpp-python[server]"` builds llama.cpp from source; its source tree's
vendor/llama.cpp builds `llama-server` with cmake) and name them here.

    python benchmarks/bench_llamacpp.py --llama-python VENV/bin/python [--llama-server BIN]
        [--configs int4-kv8-cap64]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from server_utils import ServerProcess, free_port, stop_process  # noqa: E402

from benchmarks.bench_cpu_serve import (  # noqa: E402
    MODEL,
    bench_serve,
    config_flags,
    load_figures,
    offline_ms_per_token,
    save_json,
)
from benchmarks.common import machine  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402
from kvserve.model.loader import resolve_model  # noqa: E402

END_TOKENS = (0, 2)  # SmolLM2's <|endoftext|> and <|im_end|>


class LlamaCppServer:
    """A llama.cpp server on the GGUF: llama-cpp-python's (`python` given) or llama.cpp's own
    C++ `llama-server` (`binary` given, `slots` sequences batched continuously)."""

    def __init__(self, gguf: str, threads: int, python: str | None = None, binary: str | None = None,
                 slots: int = 32, timeout: float = 180) -> None:  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        where = ["--host", "127.0.0.1", "--port", str(self.port)]
        if python:
            cmd = [python, "-m", "llama_cpp.server", "--model", gguf, *where, "--n_threads", str(threads),
                   "--n_threads_batch", str(threads), "--n_ctx", "4096", "--model_alias", MODEL,
                   "--interrupt_requests", "False"]  # fmt: skip
            out = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                                 capture_output=True, text=True)  # fmt: skip
            self.label = f"llama.cpp via llama-cpp-python {out.stdout.strip()}"
        else:
            # Each slot gets ctx/slots tokens: 256 holds a ~110-token prompt and 128 outputs.
            cmd = [binary, "-m", gguf, *where, "-t", str(threads), "-tb", str(threads), "-np", str(slots),
                   "-c", str(256 * slots), "--alias", MODEL]  # fmt: skip
            out = subprocess.run([binary, "--version"], capture_output=True, text=True)
            version = (out.stdout + out.stderr).strip().splitlines()
            self.label = f"llama.cpp llama-server ({version[0] if version else '?'}, {slots} slots)"
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {self.proc.returncode}")
            try:
                probe = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}  # answers once loaded
                if httpx.post(f"{self.url}/v1/completions", json=probe, timeout=30).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"{cmd[0]} did not answer")

    def stop(self) -> None:
        stop_process(self.proc, grace=20)


# llama.cpp's own decode time per token in one process (no server): the same prompt as
# bench_cpu_serve's offline yardstick, then `tokens` single-token evals (no sampling).
_LLAMA_OFFLINE = """
import sys, time
from llama_cpp import Llama
gguf, threads, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
m = Llama(gguf, n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)
prompt = m.tokenize(b"The history of the city begins with a small village on the river.")
best = float("inf")
for _ in range(3):
    m.reset()
    m.eval(prompt)
    t0 = time.perf_counter()
    for i in range(tokens):
        m.eval([prompt[i % len(prompt)]])
    best = min(best, (time.perf_counter() - t0) / tokens * 1000)
print(best)
"""


def llama_offline_ms_per_token(python: str, gguf: str, threads: int, tokens: int) -> float:
    out = subprocess.run([python, "-c", _LLAMA_OFFLINE, gguf, str(threads), str(tokens)],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def run_both_loads(url: str, args, out: str, extra: list[str]) -> tuple[dict, dict]:
    c1 = bench_serve(url, 1, args.c1_requests, args.output_len, out + "-c1.json", extra)
    c32 = bench_serve(url, 32, args.requests, args.output_len, out + "-c32.json", extra)
    return c1, c32


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-python", default=None, help="an interpreter with llama-cpp-python[server]")
    ap.add_argument("--llama-server", default=None, help="llama.cpp's own llama-server binary")
    ap.add_argument("--configs", default="int4-kv8-cap64", help="kvserve configurations (bench_cpu_serve.py)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--c1-requests", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:
        configs = {name: config_flags(name) for name in args.configs.split(",")}
    except ValueError as e:
        ap.error(f"--configs: {e}")
    if not (args.llama_python or args.llama_server):
        ap.error("name --llama-python and/or --llama-server")
    source = resolve_model(MODEL)
    if source.kind != "gguf":
        ap.error(f"{MODEL} did not resolve to a GGUF file: {source}")
    gguf = source.path

    results: dict[str, dict] = {}
    servers = [{"binary": args.llama_server}] if args.llama_server else []  # the baseline when given
    servers += [{"python": args.llama_python}] if args.llama_python else []
    bias = json.dumps({"logit_bias": {str(t): -100 for t in END_TOKENS}})
    with tempfile.TemporaryDirectory() as tmp:
        for i, which in enumerate(servers):
            server = LlamaCppServer(gguf, args.threads, **which)
            try:
                out = os.path.join(tmp, f"llamacpp{i}")
                c1, c32 = run_both_loads(server.url, args, out, ["--extra-body", bias])
            finally:
                server.stop()
            results[server.label] = load_figures(server.label, c1, c32)
            if "python" in which:
                results[server.label]["offline_ms_per_token"] = llama_offline_ms_per_token(
                    args.llama_python, gguf, args.threads, args.output_len
                )
            print(server.label, json.dumps(results[server.label]), flush=True)
        for name, flags in configs.items():
            kv = ServerProcess(MODEL, "--kv-cache-memory", "1GiB", *flags, api_key="bench-key", timeout=300)
            try:
                c1, c32 = run_both_loads(kv.url, args, os.path.join(tmp, name), [])
            finally:
                kv.stop()
            r = results[f"kvserve {name}"] = load_figures(name, c1, c32)
            r["offline_ms_per_token"] = offline_ms_per_token(flags, args.output_len, 3)
            print(f"kvserve {name}", json.dumps(r), flush=True)

    base = next(iter(results.values()))
    now = datetime.datetime.now(datetime.UTC)
    print(f"\n{machine()}; CPU flags: {cpu_flags()}; load average {os.getloadavg()[0]:.2f}; "
          f"{now:%Y-%m-%d %H:%M} UTC; {args.threads} threads each")  # fmt: skip
    print("| server | offline ms/token | c=1 tok/s (vs the first) | c=1 ITL p50 | c=32 tok/s (vs the first) "
          "| c=32 ITL p50 / p99 | c=32 TTFT p50 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        c1, c32 = r["c1_tok_s"], r["c32_tok_s"]
        offline = f"{r['offline_ms_per_token']:.2f}" if "offline_ms_per_token" in r else "-"
        print(f"| {name} | {offline} | {c1:.1f} ({c1 / base['c1_tok_s']:.2f}x) | "
              f"{r['c1_itl_p50_ms']:.1f} ms | {c32:.1f} ({c32 / base['c32_tok_s']:.2f}x) | "
              f"{r['c32_itl_p50_ms']:.0f} / {r['c32_itl_p99_ms']:.0f} ms | "
              f"{r['c32_ttft_p50_ms']:.0f} ms |")  # fmt: skip
    if args.json:
        save_json(args.json, args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
