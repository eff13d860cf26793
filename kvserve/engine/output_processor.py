"""Output processing: engine-core token outputs -> text, stop strings, RequestOutputs.

Keeps each live request's detokenizer and accumulated tokens. A stop string ends the
request here (finish_reason "stop"); the caller then aborts it in the engine core so its
blocks are freed.
"""

from __future__ import annotations

import time

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.messages import EngineCoreOutput, EngineCoreRequest
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.request import BACKGROUND_PRIORITY
from kvserve.tokenizer import Tokenizer


class RequestState:
    def __init__(self, req: EngineCoreRequest, prompt: str | None, tokenizer: Tokenizer) -> None:
        self.request_id = req.request_id
        self.prompt = prompt
        self.prompt_token_ids = req.prompt_token_ids
        self.params = req.params
        self.detok = IncrementalDetokenizer(tokenizer, req.params)
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if req.params.logprobs is not None else None
        self.logprob_ranks: list[int | None] | None = [] if req.params.logprobs is not None else None
        self.cumulative_logprob = 0.0  # of the sampled tokens, kept as they come (not re-summed per step)
        self.beam_cum_logprob: float | None = None  # a beam search result's, from the engine
        self.prompt_logprobs = None
        self.prompt_logprob_ranks: list[int | None] | None = None
        self.num_cached_tokens = 0
        self.metrics = RequestMetrics(req.arrival_time, background=req.priority == BACKGROUND_PRIORITY)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.embedding: list[float] | None = None
        self.kv_transfer_params: dict | None = None

    def make_output(
        self, new_token_ids: list[int], new_logprobs: list[dict[int, float]] | None = None
    ) -> RequestOutput:
        finished = self.finish_reason is not None
        if finished:
            self.detok.finish(self.token_ids)
        delta_text = self.detok.release(finished)
        a, b = self.detok.release_tokens(finished)
        cumulative = self.cumulative_logprob if self.logprobs is not None else self.beam_cum_logprob
        completion = CompletionOutput(
            index=0,
            text=self.detok.text,
            token_ids=self.token_ids if not finished else list(self.token_ids),  # grows until finished
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
            logprob_ranks=self.logprob_ranks,
            cumulative_logprob=cumulative,
            delta_text=delta_text,
            delta_token_ids=new_token_ids,
            delta_logprobs=new_logprobs if self.logprobs is not None else None,
            text_token_ids=self.token_ids[a:b],
            text_logprobs=self.logprobs[a:b] if self.logprobs is not None else None,
        )
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, [completion], finished, self.metrics,
            self.prompt_logprobs, self.num_cached_tokens, self.embedding, self.kv_transfer_params,
            self.prompt_logprob_ranks,
        )  # fmt: skip


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, req: EngineCoreRequest, prompt: str | None = None) -> None:
        self.states[req.request_id] = RequestState(req, prompt, self.tokenizer)

    def has_unfinished(self) -> bool:
        return bool(self.states)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """RequestOutputs for these core outputs, and ids the core must abort (stop strings)."""
        results, to_abort = [], []
        for out in outputs:
            st = self.states.get(out.request_id)
            if st is None:
                continue  # already finished here (e.g. stop string) while the core stepped on
            m = st.metrics
            if out.first_token_time is not None:
                m.first_scheduled_time, m.first_token_time = out.first_scheduled_time, out.first_token_time
                st.prompt_logprobs = out.prompt_logprobs
                st.prompt_logprob_ranks = out.prompt_logprob_ranks
                st.num_cached_tokens = out.num_cached_tokens
            if out.embedding is not None:
                st.embedding = out.embedding
            if out.kv_transfer_params is not None:
                st.kv_transfer_params = out.kv_transfer_params
            if out.cumulative_logprob is not None:  # beam search: logprobs are refused, the sum is known
                st.beam_cum_logprob = out.cumulative_logprob
            # Token by token: with speculative decoding a step brings several, and a stop
            # string completed by one of them ends the output there.
            new_ids, new_logprobs, stop = out.new_token_ids, out.new_logprobs, None
            textless = len(new_ids) - 1 if out.stopped_on_token and not st.detok.include_stop else -1
            for j, token in enumerate(new_ids):
                st.token_ids.append(token)
                if j == textless:  # the EOS or stop token id that ended it
                    st.detok.skip_stop_token()
                    break
                stop = st.detok.update(st.token_ids)  # min_tokens: the detokenizer skips their text
                if stop is not None:
                    new_ids = new_ids[: j + 1]
                    new_logprobs = new_logprobs[: j + 1] if new_logprobs else new_logprobs
                    break
            if st.logprobs is not None and new_logprobs:
                st.logprobs.extend(new_logprobs)
                ranks = out.new_logprob_ranks or [None] * len(new_logprobs)
                st.logprob_ranks.extend(ranks[: len(new_logprobs)])  # cut where a stop string cut
                st.cumulative_logprob += sum(lp[t] for t, lp in zip(new_ids, new_logprobs))
            if stop is not None:
                st.finish_reason, st.stop_reason = "stop", stop
                if out.finish_reason is None:
                    to_abort.append(out.request_id)
            elif out.finish_reason is not None:
                st.finish_reason, st.stop_reason = out.finish_reason, out.stop_reason
            if st.finish_reason is not None:
                m.finished_time = out.finished_time or time.monotonic()
                m.num_preemptions = out.num_preemptions
                del self.states[out.request_id]
            results.append(st.make_output(new_ids, new_logprobs))
        return results, to_abort

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request as aborted; returns its final output if it was live."""
        st = self.states.pop(request_id, None)
        if st is None:
            return None
        st.finish_reason = "abort"
        st.metrics.finished_time = time.monotonic()
        return st.make_output([])
