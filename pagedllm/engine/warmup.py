"""The start-up warm-up: a first request's one-time costs, paid before the engine says it is ready.

What a first request sets up once: the OpenMP thread team of the thread that steps the engine (libgomp keeps
one per calling thread), the quantized linears' scratch buffer (one per thread, grown on the first batched
prefill) and oneDNN's GEMM behind it, the fused C decode loop's plan, the sampler's paths, the prefix cache's
hashing and the chat template's compiled form (~10 ms). So the warm-up runs the real path on the thread that
will step the engine: two tiny requests (a greedy prefill long enough for the batched kernels, a sampled one
with logprobs; a decode of two rows, then of one), their detokenization, and one chat-template render.

Measured with `benchmarks/first_request.py` (SmolLM2-135M, 16 tokens): on a quiet 2-core machine these cost a
first request little (0.16 s against 0.14 s for the next, with or without the warm-up). The ~5 s first requests
seen while other work loaded the machine were OpenMP's spin-waiting (their first decode steps took ~600 ms of
CPU each in libgomp's barrier loop); under such load it also hits later requests after an idle gap, and no
warm-up removes it.

It leaves no trace: it runs on an :class:`EngineCore` and an :class:`OutputProcessor` of its own, dropped
afterwards, so the engine's block pool, prefix cache, statistics, step history and request ids start untouched;
its requests have ids of their own (the engine numbers its requests from 0), and their sampling draws from
per-request generators (never the global RNG). A last empty step tells the workers the requests are gone.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.core import EngineCore
    from pagedllm.engine.llm_engine import LLMEngine, PreparedRequest

logger = logging.getLogger("pagedllm")

WARMUP_REQUEST_ID = "pagedllm-warmup"
PROMPT = (  # cut to PROMPT_TOKENS (its last ones) and to 4
    "The quick brown fox jumps over the lazy dog, then runs back home across the field to sleep. In the morning "
    "it wakes early, drinks from the cold river and goes looking for breakfast along the edge of the wood."
)
PROMPT_TOKENS = 24  # more rows than the quantized linears' direct kernels take: the batched path warms too
MAX_TOKENS = 4  # the prefill's token, then three decode steps: the first builds the fused loop's plan
# the warm-up's core has a pool of its own this size at most: its two requests' few dozen tokens in every KV
# group, at any block size (a pool the size of the engine's, ~10^5 blocks, took 0.4 s to build)
WARMUP_BLOCKS = 256


def warm_up(engine: LLMEngine, core: EngineCore) -> None:
    """Run :func:`warmup_requests` through ``core`` (a throwaway core over the engine's executor) to the end."""
    out = OutputProcessor(engine.tokenizer)
    for prepared in warmup_requests(engine):
        out.add_request(prepared.request_id, prepared.children, prepared.prompt)
        core.add_request(prepared.children[0])
    while core.has_unfinished_requests():
        _, to_stop = out.process(core.step())
        for rid, stop in to_stop:
            core.finish_request(rid, stop)
    core.step()  # an empty step carrying the finished ids: the workers drop the requests' state
    if not engine.is_pooling:
        render_chat_template(engine.tokenizer)


def warmup_requests(engine: LLMEngine) -> list[PreparedRequest]:
    """A greedy request with a prompt of PROMPT_TOKENS tokens (fewer where max_model_len is small), and a
    sampled one of a few tokens that stops after one decode step (so the decodes run two rows, then one):
    the sampled rows' top-k / top-p sort is a step's dearest part on a small model. For a pooling model,
    one prompt to embed."""
    if engine.is_pooling:
        from pagedllm.pooling_params import PoolingParams

        truncate = min(PROMPT_TOKENS, engine.max_model_len)
        return engine.make_pooling_requests([WARMUP_REQUEST_ID], [PROMPT], PoolingParams(truncate))
    # a prompt leaves room for one output token, and fits one step where prompts are not chunked
    room = min(engine.max_model_len - 1, engine.config.scheduler_config.max_num_batched_tokens)
    if room < 1:  # max_model_len 1: no request can run
        return []
    greedy = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, truncate_prompt_tokens=min(PROMPT_TOKENS, room)
    )
    sampled = SamplingParams(
        max_tokens=2,
        temperature=0.8,
        top_p=0.9,
        top_k=20,
        seed=0,
        logprobs=min(1, engine.config.model_config.max_logprobs),
        ignore_eos=True,
        truncate_prompt_tokens=min(4, room),
    )
    return [
        engine.make_request(f"{WARMUP_REQUEST_ID}-{i}", PROMPT, params) for i, params in enumerate((greedy, sampled))
    ]


def render_chat_template(tokenizer: Any) -> None:
    """Render a one-message conversation, so the template's compiled form is cached (transformers keeps it by
    the template's text) before the first chat request; a template that cannot render it is left to fail
    there, with the request's own messages."""
    if getattr(tokenizer, "chat_template", None) is None:
        return
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    except Exception as e:  # e.g. a template that insists on a system message
        logger.debug("warm-up: the chat template did not render a one-message conversation: %s", e)
