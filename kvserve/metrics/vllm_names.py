"""`--metrics-compat vllm`: every kvserve:* series again as vllm:*, under the names vLLM's
Grafana dashboards query, so one of them works against kvserve unchanged.

Our series are named as vLLM's, so the prefix is all that changes, except where vLLM's name
differs: its iteration-tokens histogram is `iteration_tokens_total`, and its dashboards
still read two names it had before v0.10 (each also given under the newer one):
`gpu_cache_usage_perc` (now `kv_cache_usage_perc`) and `time_per_output_token_seconds`
(what vLLM v1 observed per output token, the inter-token latency: now
`inter_token_latency_seconds`)."""

from __future__ import annotations

RENAMED = {b"vllm:iteration_tokens": b"vllm:iteration_tokens_total"}
ALSO_AS = {
    b"vllm:kv_cache_usage_perc": b"vllm:gpu_cache_usage_perc",
    b"vllm:inter_token_latency_seconds": b"vllm:time_per_output_token_seconds",
}
_SUFFIXES = (b"", b"_bucket", b"_count", b"_sum", b"_created", b"_total")


def _name(line: bytes) -> tuple[bytes, bytes, bytes]:
    """(what comes before the series' name, the name, the rest) of an exposition line."""
    head = b""
    for comment in (b"# HELP ", b"# TYPE "):
        if line.startswith(comment):
            head, line = comment, line[len(comment) :]
    end = min((i for i in (line.find(b"{"), line.find(b" ")) if i >= 0), default=len(line))
    return head, line[:end], line[end:]


def _family(name: bytes, names: dict[bytes, bytes]) -> tuple[bytes, bytes] | None:
    """(family, suffix) when `name` is a series of one of `names`' families."""
    for family in names:
        if name.startswith(family) and name[len(family) :] in _SUFFIXES:
            return family, name[len(family) :]
    return None


def vllm_series(body: bytes) -> bytes:
    """The vllm:* copy of a kvserve:* exposition (appended to it by the /metrics route)."""
    out, extra = [], []
    for line in body.replace(b"kvserve:", b"vllm:").splitlines():
        head, name, rest = _name(line)
        if hit := _family(name, RENAMED):
            line = head + RENAMED[hit[0]] + hit[1] + rest
        elif hit := _family(name, ALSO_AS):
            extra.append(head + ALSO_AS[hit[0]] + hit[1] + rest)
        out.append(line)
    return b"\n".join(out + extra) + b"\n"
