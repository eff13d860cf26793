"""`kvserve:saturation`: one number an autoscaler can target, the share of a replica's
capacity in use.

A replica runs out of one of two things: KV blocks (long contexts) or batch seats
(`max_num_seqs`, many short requests). Whichever is closer to full is the replica's load:

    saturation = max(kv_cache_usage, running / max_num_seqs) + waiting / max_num_seqs

The first term is 0-1 and answers "how full is it"; the second is queueing pressure and
answers "how much more is asked of it than it can hold": each full batch of requests waiting
adds 1. So below 1 the replica has room; above 1 requests wait, and a scale-out target of
0.7-0.9 keeps headroom for a burst without waiting for queues to form (request counts alone
react too late, and KV usage alone misses many short requests). With data-parallel replicas
the server's `engine="total"` series is the mean over its replicas.
"""

from __future__ import annotations


def saturation(running: int, waiting: int, kv_usage: float, max_num_seqs: int) -> float:
    """The formula above; max_num_seqs < 1 is treated as 1 so the gauge never divides by 0."""
    seats = max(1, max_num_seqs)
    return max(min(kv_usage, 1.0), running / seats) + waiting / seats
