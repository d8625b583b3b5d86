"""OutputProcessor: token ids from the core → text, stop strings, logprobs → RequestOutput."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.core import EngineCoreOutput
from pagedllm.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.request import Request


@dataclass
class _OutState:
    prompt: str | None
    detok: IncrementalDetokenizer | None
    text: str = ""
    cumulative_logprob: float | None = None
    logprobs: list | None = None
    stop_string: str | None = None
    last_token_time: float | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.states: dict[str, _OutState] = {}

    def add_request(self, request: Request, prompt: str | None) -> None:
        sp = request.sampling_params
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, sp.skip_special_tokens) \
            if sp.detokenize else None
        track_lp = sp.logprobs is not None
        self.states[request.request_id] = _OutState(prompt, detok, cumulative_logprob=0.0 if track_lp else None,
                                                    logprobs=[] if track_lp else None)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Returns the request outputs and the (request id, stop string) pairs the core must stop."""
        results, to_stop = [], []
        now = time.monotonic()
        for out in outputs:
            req = out.request
            st = self.states.get(req.request_id)
            if st is None:
                continue
            if out.new_token_ids:
                st.last_token_time = now
            for lp in out.new_logprobs:
                st.cumulative_logprob += lp.logprobs[0]
                entry = {}
                for rank, (tid, val) in enumerate(zip(lp.token_ids[1:], lp.logprobs[1:]), start=1):
                    entry[tid] = Logprob(val, rank, self._tok_text(tid))
                entry.setdefault(lp.token_ids[0], Logprob(lp.logprobs[0], lp.sampled_rank,
                                                          self._tok_text(lp.token_ids[0])))
                st.logprobs.append(entry)
            stopped_here = False
            if st.detok is not None and st.stop_string is None:
                delta = st.detok.step(out.new_token_ids, final=out.finished)
                st.text += delta
                sp = req.sampling_params
                if delta and sp.stop:
                    hit = find_stop_string(st.text, len(delta), sp.stop, sp.include_stop_str_in_output)
                    if hit is not None:
                        st.stop_string, cut = hit
                        st.text = st.text[:cut]
                        stopped_here = not out.finished
            if stopped_here:
                to_stop.append((req.request_id, st.stop_string))
            finished = out.finished or stopped_here
            results.append(self._make_output(req, st, finished))
            if finished:
                del self.states[req.request_id]
        return results, to_stop

    def _tok_text(self, tid: int) -> str:
        return self.tokenizer.decode([tid])

    def _make_output(self, req: Request, st: _OutState, finished: bool) -> RequestOutput:
        if st.stop_string is not None:
            finish_reason, stop_reason = "stop", st.stop_string
        else:
            finish_reason, stop_reason = req.finish_reason, req.stop_reason
        text = st.text
        stops = req.sampling_params.stop
        if stops and not finished:
            # hold back what could be the start of a stop string, so streamed text never has to shrink
            text = text[:max(0, len(text) - (max(map(len, stops)) - 1))]
        completion = CompletionOutput(0, text, list(req.output_token_ids), st.cumulative_logprob,
                                      st.logprobs, finish_reason if finished else None,
                                      stop_reason if finished else None)
        now = time.monotonic()
        metrics = RequestMetrics(
            arrival_time=req.arrival_time, first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time, last_token_time=st.last_token_time,
            finished_time=now if finished else None,
            time_in_queue=(req.first_scheduled_time - req.arrival_time) if req.first_scheduled_time else None)
        return RequestOutput(req.request_id, st.prompt, req.prompt_token_ids, [completion], finished,
                             max(req.num_cached_tokens, 0), metrics)
