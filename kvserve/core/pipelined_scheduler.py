"""Two (or N) interleaved batch streams for pipeline parallelism: vLLM's virtual engines.

With P pipeline stages, stage 0 can start step i+1 while stage 1 still runs step i, but only
if step i+1 does not need step i's tokens. So every request belongs to one of P streams for
its whole life (the stream with the fewest requests when it arrives), each stream is an
ordinary `Scheduler`, and the engine schedules the streams in turn, one step each, keeping
at most one step per stream in flight. A stream is only scheduled when its previous step has
been collected, so none of its requests is in the pipe: preemption and chunked prefill work
exactly as with one stream.

The streams share one KV cache manager (one block pool, one prefix cache: a prefix computed
by one stream is a hit for the other) and split the seats (`max_num_seqs`); each step keeps
the whole token budget. Sharing blocks between steps in flight is safe because every stage
runs steps in the order they were sent and holds only its own layers' KV: a block freed by
one stream and reused by the other is written by stage s only after stage s finished the
earlier step.

This class offers the parts of `Scheduler`'s interface the engine core uses; `schedule` and
`update` take the stream.
"""

from __future__ import annotations

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.scheduler import Scheduler, SchedulerOutput
from kvserve.model.layers.sampler import SampleResult
from kvserve.request import Request, RequestStatus


class PipelinedScheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: str,
        num_streams: int,
    ) -> None:
        seats = -(-max_num_seqs // num_streams)
        self.streams = [
            Scheduler(kv_cache_manager, seats, max_num_batched_tokens, max_model_len, policy)
            for _ in range(num_streams)
        ]
        self.requests: dict[str, Request] = {}  # shared by the streams (ids are unique)
        self.spec_stats = self.streams[0].spec_stats
        for s in self.streams:
            s.requests, s.spec_stats = self.requests, self.spec_stats
        self._stream_of: dict[str, int] = {}
        self.next_stream = 0  # whose turn it is
        self.waiting_for_kv: dict[str, Request] = {}  # (no KV connector under pipeline parallelism)

    @property
    def running(self) -> list[Request]:
        return [r for s in self.streams for r in s.running]

    @property
    def waiting(self) -> list[Request]:
        return [r for s in self.streams for r in s.waiting]

    @property
    def num_preemptions_total(self) -> int:
        return sum(s.num_preemptions_total for s in self.streams)

    @property
    def num_lookahead_slots(self) -> int:
        return 0

    @property
    def max_num_seqs(self) -> int:
        """Seats of one stream: the most one group (beams, n samples) can hold at once."""
        return min(s.max_num_seqs for s in self.streams)

    def add_fork(self, child: Request, parent: Request) -> None:
        """A fork lives in its parent's stream (it shares the parent's blocks and steps)."""
        i = self._stream_of[parent.request_id]
        self._stream_of[child.request_id] = i
        self.streams[i].add_fork(child, parent)

    def add_request(self, request: Request) -> None:
        load = [len(s.running) + len(s.waiting) for s in self.streams]
        i = load.index(min(load))
        self._stream_of[request.request_id] = i
        self.streams[i].add_request(request)

    def has_unfinished_requests(self) -> bool:
        return any(s.has_unfinished_requests() for s in self.streams)

    def num_waiting_background(self) -> int:
        return sum(s.num_waiting_background() for s in self.streams)

    def schedule_stream(self, i: int) -> SchedulerOutput:
        return self.streams[i].schedule()

    def update(
        self, i: int, out: SchedulerOutput, sampled: dict[str, SampleResult]
    ) -> list[tuple[Request, int]]:
        """Stream i's step came back. Requests that ended while it was in flight (aborted,
        a stop string) are skipped: their blocks are already free."""
        live = SchedulerOutput([(r, n) for r, n in out.scheduled if not r.is_finished], out.num_preempted)
        progressed = self.streams[i].update(live, sampled)
        for req, _ in out.scheduled:
            if req.is_finished:
                self._stream_of.pop(req.request_id, None)
        return progressed

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        i = self._stream_of.pop(request_id, None)
        return None if i is None else self.streams[i].finish_request(request_id, status)

    def preempt(self, req: Request) -> None:
        i = self._stream_of.get(req.request_id)
        if i is not None:
            self.streams[i].preempt(req)
