"""OutputProcessor: token ids from the core → text, stop strings, logprobs → RequestOutput.

A user request with ``n`` completions is ``n`` child requests in the core; here
their completions are gathered back into one RequestOutput per user request,
finished once every child is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.core import EngineCoreOutput
from pagedllm.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from pagedllm.engine.pooling import EmbeddingOutput, EmbeddingRequestOutput
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import RequestOutputKind


@dataclass
class _ChildState:
    parent_id: str
    index: int
    detok: IncrementalDetokenizer | None
    text: str = ""
    cumulative_logprob: float | None = None
    logprobs: list | None = None
    stop_string: str | None = None
    num_tokens: int | None = None  # the output tokens that count, when a stop string ended a multi-token step


@dataclass
class _ParentState:
    prompt: str | None
    leader: Request
    requests: list[Request]  # every completion's request, the leader first
    child_ids: list[str]
    completions: list[CompletionOutput]
    finished: set[int] = field(default_factory=set)
    last_token_time: float | None = None
    prompt_logprobs: list | None = None
    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    sent: dict[int, tuple[int, int]] = field(default_factory=dict)  # DELTA: index -> (chars, tokens) sent
    emitted: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.children: dict[str, _ChildState] = {}
        self.parents: dict[str, _ParentState] = {}
        self.pooling: dict[str, str | None] = {}  # pooling requests: id -> prompt text

    def add_request(self, request_id: str, children: list[Request], prompt: str | None) -> None:
        if children[0].pooling_params is not None:  # one vector, in the step it finishes: nothing to gather
            self.pooling[request_id] = prompt
            return
        for req in children:
            sp = req.sampling_params
            detok = (
                IncrementalDetokenizer(
                    self.tokenizer, req.prompt_token_ids, sp.skip_special_tokens, sp.spaces_between_special_tokens
                )
                if sp.detokenize
                else None
            )
            track_lp = sp.logprobs is not None
            self.children[req.request_id] = _ChildState(
                request_id,
                req.index,
                detok,
                cumulative_logprob=0.0 if track_lp else None,
                logprobs=[] if track_lp else None,
            )
        empty = [CompletionOutput(i, "", [], None, None) for i in range(len(children))]
        leader = children[0]
        kind = leader.sampling_params.output_kind
        assert isinstance(kind, RequestOutputKind)  # SamplingParams parses a name into the enum
        self.parents[request_id] = _ParentState(
            prompt,
            leader,
            list(children),
            [c.request_id for c in children],
            empty,
            prompt_logprobs=[None] * leader.num_prompt_tokens
            if leader.sampling_params.prompt_logprobs is not None
            else None,
            kind=kind,
        )

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return parent.child_ids if parent is not None else [request_id]

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Returns the request outputs (EmbeddingRequestOutput for pooling requests) and the (child request id,
        stop string) pairs the core must stop."""
        to_stop: list[tuple[str, str]] = []
        touched: dict[str, _ParentState] = {}
        now = time.monotonic()
        results: list = []
        for out in outputs:
            req = out.request
            if req.request_id in self.pooling:
                if out.finished:
                    results.append(self._pooling_output(out, self.pooling.pop(req.request_id), now))
                continue
            st = self.children.get(req.request_id)
            if st is None:
                continue
            parent = self.parents[st.parent_id]
            if out.new_token_ids:
                parent.last_token_time = now
            if out.prompt_logprobs is not None and parent.prompt_logprobs is not None:
                first, entries = out.prompt_logprobs
                for j, lp in enumerate(entries):  # by position: a recompute after preemption overwrites
                    parent.prompt_logprobs[first + j] = self._logprob_entry(lp)
            if not out.new_token_ids and not out.finished:
                touched[st.parent_id] = parent  # a prefill chunk with prompt logprobs, nothing sampled yet
                continue
            stopped_here = False
            kept = len(out.new_token_ids)
            if st.detok is not None and st.stop_string is None:
                sp = req.sampling_params
                stops = sp.stop
                assert not isinstance(stops, str)  # SamplingParams makes a lone stop string a list
                # several tokens in one step (speculative decoding) with stop strings: one at a time, so the
                # output ends at the token that completed the stop string, exactly as without speculation
                text_ids = out.new_token_ids
                if req.status == RequestStatus.FINISHED_STOPPED and not sp.include_stop_str_in_output:
                    text_ids = text_ids[:-1]  # ended by EOS or a stop_token_id: its text is not output (vLLM)
                steps = [[t] for t in text_ids] if stops and len(text_ids) > 1 else [text_ids]
                for j, ids in enumerate(steps):
                    delta = st.detok.step(ids, final=out.finished and j == len(steps) - 1)
                    st.text += delta
                    if delta and stops:
                        hit = find_stop_string(st.text, len(delta), stops, sp.include_stop_str_in_output)
                        if hit is not None:
                            st.stop_string, cut = hit
                            st.text = st.text[:cut]
                            stopped_here = not out.finished
                            if j < len(steps) - 1:
                                kept = j + 1
                                st.num_tokens = req.num_output_tokens - (len(steps) - kept)
                            break
            new_logprobs = out.new_logprobs[:kept]
            if new_logprobs:  # only a request that asked for logprobs gets them
                assert st.cumulative_logprob is not None and st.logprobs is not None
                for lp in new_logprobs:
                    st.cumulative_logprob += lp.logprobs[0]
                    st.logprobs.append(self._logprob_entry(lp))
            if stopped_here:
                assert st.stop_string is not None  # stopped_here: a stop string was found above
                to_stop.append((req.request_id, st.stop_string))
            finished = out.finished or stopped_here
            if finished or parent.kind != RequestOutputKind.FINAL_ONLY:  # nobody reads it otherwise
                parent.completions[st.index] = self._completion(req, st, finished)
            if finished:
                parent.finished.add(st.index)
                del self.children[req.request_id]
            touched[st.parent_id] = parent
        for rid, parent in touched.items():
            done = len(parent.finished) == len(parent.child_ids)
            if done or parent.kind != RequestOutputKind.FINAL_ONLY:
                results.append(self._request_output(rid, parent, done, now))
            if done:
                del self.parents[rid]
        return results, to_stop

    @staticmethod
    def _pooling_output(out: EngineCoreOutput, prompt: str | None, now: float) -> EmbeddingRequestOutput:
        req = out.request
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=None,
            last_token_time=None,
            finished_time=now,
            time_in_queue=(req.first_scheduled_time - req.arrival_time) if req.first_scheduled_time else None,
        )
        vector = out.pooling_output
        return EmbeddingRequestOutput(
            req.request_id,
            req.prompt_token_ids,
            None if vector is None else EmbeddingOutput(vector),
            True,
            metrics,
            prompt,
        )

    def _tok_text(self, tid: int) -> str:
        return self.tokenizer.decode([tid])

    def _logprob_entry(self, lp) -> dict[int, Logprob]:
        """Top-N by rank first, then the chosen token (if it is not among them) with its own rank."""
        entry = {
            tid: Logprob(val, rank, self._tok_text(tid))
            for rank, (tid, val) in enumerate(zip(lp.token_ids[1:], lp.logprobs[1:]), start=1)
        }
        entry.setdefault(lp.token_ids[0], Logprob(lp.logprobs[0], lp.sampled_rank, self._tok_text(lp.token_ids[0])))
        return entry

    @staticmethod
    def _completion(req: Request, st: _ChildState, finished: bool) -> CompletionOutput:
        finish_reason: str | None
        stop_reason: int | str | None
        if st.stop_string is not None:
            finish_reason, stop_reason = "stop", st.stop_string
        else:
            finish_reason, stop_reason = req.finish_reason, req.stop_reason
        text = st.text
        stops = req.sampling_params.stop
        if stops and not finished:
            # hold back what could be the start of a stop string, so streamed text never has to shrink
            text = text[: max(0, len(text) - (max(map(len, stops)) - 1))]
        return CompletionOutput(
            st.index,
            text,
            req.output_token_ids[: st.num_tokens],
            st.cumulative_logprob,
            list(st.logprobs) if st.logprobs is not None else None,
            finish_reason if finished else None,
            stop_reason if finished else None,
        )

    @staticmethod
    def _request_output(request_id: str, parent: _ParentState, finished: bool, now: float) -> RequestOutput:
        req = parent.leader
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            last_token_time=parent.last_token_time,
            finished_time=now if finished else None,
            time_in_queue=(req.first_scheduled_time - req.arrival_time) if req.first_scheduled_time else None,
        )
        if any(r.num_draft_tokens for r in parent.requests):
            metrics.spec_num_draft_tokens = sum(r.num_draft_tokens for r in parent.requests)
            metrics.spec_num_accepted_tokens = sum(r.num_accepted_tokens for r in parent.requests)
        plp = list(parent.prompt_logprobs) if parent.prompt_logprobs is not None else None
        completions = list(parent.completions)
        if parent.kind == RequestOutputKind.DELTA:
            completions = [OutputProcessor._delta(parent, c) for c in completions]
            if parent.emitted:
                plp = None  # prompt logprobs travel with the first delta only
        parent.emitted = True
        return RequestOutput(
            request_id,
            parent.prompt,
            req.prompt_token_ids,
            completions,
            finished,
            max(req.num_cached_tokens, 0),
            metrics,
            plp,
            req.kv_transfer_params if finished else None,
        )

    @staticmethod
    def _delta(parent: _ParentState, c: CompletionOutput) -> CompletionOutput:
        chars, tokens = parent.sent.get(c.index, (0, 0))
        parent.sent[c.index] = (len(c.text), len(c.token_ids))
        return CompletionOutput(
            c.index,
            c.text[chars:],
            c.token_ids[tokens:],
            c.cumulative_logprob,
            c.logprobs[tokens:] if c.logprobs is not None else None,
            c.finish_reason,
            c.stop_reason,
        )
