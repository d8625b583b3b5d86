"""Beam search on top of the engine, with transformers' exact algorithm and vLLM's API.

``LLM.beam_search(prompts, BeamSearchParams(beam_width, max_tokens, length_penalty, early_stopping))``

Each step every live beam is a one-token request asking for its top ``2k``
logprobs (``k`` = beam width); the beams share their common prefix through the
prefix cache, so only new tokens are computed. Candidate selection, finished
hypotheses, length penalty and the early-stopping rules follow transformers'
``generate(num_beams=...)``:

* the best ``max(2, 1 + #eos) * k`` continuations over all beams are ranked by cumulative logprob;
* among the top ``k`` of them, those ending in EOS (or reaching max_tokens) become finished
  hypotheses scored ``logprob_sum / generated_len ** length_penalty``; the best ``k`` kept;
* the best ``k`` continuations that did not finish are the next beams;
* ``early_stopping=True`` stops once ``k`` hypotheses exist; ``False`` once the best running
  beam (scored at the current length) cannot beat the worst hypothesis; ``"never"`` uses
  max length for that estimate when length_penalty > 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pagedllm.errors import InvalidParameterError

_NEG = -1.0e9


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidParameterError(f"{name} must be an integer >= 1, got {v!r}", name)
        if self.temperature != 0.0:
            raise InvalidParameterError("beam search ranks beams by raw logprobs: temperature must be 0", "temperature")
        if self.early_stopping not in (True, False, "never"):
            raise InvalidParameterError(
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}", "early_stopping"
            )


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated
    cum_logprob: float
    score: float  # cum_logprob / generated_len ** length_penalty
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class _State:
    prompt: list[int]
    running: list[tuple[list[int], float]]  # (tokens, cumulative logprob), best first
    finished: list[tuple[float, list[int], float, str]] = field(default_factory=list)  # (score, tokens, cum, reason)
    improvable: bool = True
    done: bool = False


def beam_search(
    engine: Any, prompts: list[list[int]], params: BeamSearchParams, lora_request: Any = None
) -> list[BeamSearchOutput]:
    from pagedllm.sampling_params import SamplingParams

    k = params.beam_width
    eos = set() if params.ignore_eos else set(engine.processor.eos_token_ids)
    keep = max(2, 1 + len(eos)) * k
    if keep > engine.processor.max_logprobs:
        raise InvalidParameterError(
            f"beam_width={k} needs {keep} logprobs per step, above max_logprobs={engine.processor.max_logprobs}; "
            "raise max_logprobs",
            "beam_width",
        )
    states = [_State(list(p), [(list(p), 0.0)]) for p in prompts]
    step_params = SamplingParams(temperature=0, max_tokens=1, logprobs=keep, ignore_eos=True, detokenize=False)
    for _ in range(params.max_tokens):
        live = [s for s in states if not s.done]
        if not live:
            break
        ids: dict[str, tuple[_State, int]] = {}
        for s in live:
            for bi, (tokens, _) in enumerate(s.running):
                rid = f"beam-{id(s)}-{bi}"
                engine.add_request(rid, {"prompt_token_ids": tokens}, step_params, lora_request=lora_request)
                ids[rid] = (s, bi)
        top: dict[tuple[int, int], list[tuple[int, float]]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id in ids:
                    s, bi = ids[out.request_id]
                    entry = out.outputs[0].logprobs[0]
                    top[(id(s), bi)] = [(t, lp.logprob) for t, lp in entry.items()]
        for s in live:
            _advance(s, top, k, keep, eos, params)
    return [_finish(s, k, engine.tokenizer) for s in states]


def _advance(s: _State, top: dict, k: int, keep: int, eos: set[int], params: BeamSearchParams) -> None:
    cur_len = len(s.running[0][0])
    max_len = len(s.prompt) + params.max_tokens
    cands = sorted(
        ((score + lp, tokens + [t]) for bi, (tokens, score) in enumerate(s.running) for t, lp in top[(id(s), bi)]),
        key=lambda c: -c[0],
    )[:keep]
    stops = [(c[1][-1] in eos) or cur_len + 1 >= max_len for c in cands]
    # finished hypotheses: only among the best k, only while improvement is possible
    full = len(s.finished) >= k and params.early_stopping is True
    if s.improvable and not full:
        gen_len = cur_len + 1 - len(s.prompt)
        for (score, tokens), stop in zip(cands[:k], stops[:k]):
            if stop:
                reason = "stop" if tokens[-1] in eos else "length"
                s.finished.append((score / gen_len**params.length_penalty, tokens, score, reason))
        s.finished = sorted(s.finished, key=lambda f: -f[0])[:k]
    s.running = [(tokens, score) for (score, tokens), stop in zip(cands, stops) if not stop][:k]
    cur_len += 1
    if len(s.finished) >= k and s.running:
        if params.early_stopping == "never" and params.length_penalty > 0:
            best_len = max_len - len(s.prompt)
        else:
            best_len = cur_len - len(s.prompt)
        best_possible = s.running[0][1] / best_len**params.length_penalty
        s.improvable = s.improvable and best_possible > s.finished[-1][0]
    all_finished = len(s.finished) >= k
    s.done = not s.improvable or (all_finished and params.early_stopping is True) or not s.running or cur_len >= max_len


def _finish(s: _State, k: int, tokenizer: Any) -> BeamSearchOutput:
    seqs = [
        BeamSearchSequence(
            tokens, cum, score, tokenizer.decode(tokens[len(s.prompt) :], skip_special_tokens=True), reason
        )
        for score, tokens, cum, reason in s.finished[:k]
    ]
    return BeamSearchOutput(seqs)
