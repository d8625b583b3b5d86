"""AsyncLLM on its own: streams match offline generation, and a stream that is closed unread is aborted."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.errors import InvalidParameterError

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return str(tiny_model_factory("llama"))


def test_streams_match_offline_and_unread_streams_free_their_blocks(model_dir):
    kwargs = dict(model=model_dir, max_model_len=256, num_gpu_blocks_override=64)
    llm = AsyncLLM.from_kwargs(max_queue_len=16, **kwargs)

    async def main():
        single = [out async for out in llm.generate("Hello there", GREEDY)]
        batch = await llm.add_requests(["one", "two", "three"], GREEDY)
        finals = []
        for s in batch:  # (an async comprehension inside a comprehension needs Python 3.11)
            finals.append([out async for out in s][-1])
        abandoned = await llm.add_requests(["never read"], SamplingParams(max_tokens=200, ignore_eos=True))
        await abandoned[0].aclose()  # before its first output: it must still be aborted
        with pytest.raises(InvalidParameterError, match="max_queue_len=16"):
            await llm.add_requests(["x"] * 17, GREEDY)
        return single, finals

    try:
        single, finals = asyncio.run(main())
        offline = LLM(**kwargs).generate(["Hello there", "one", "two", "three"], GREEDY, use_tqdm=False)
        assert single[-1].finished and [o.outputs[0].token_ids for o in offline] == [
            single[-1].outputs[0].token_ids,
            *[f.outputs[0].token_ids for f in finals],
        ]
        core = llm.engine.core
        deadline = time.time() + 10
        while core.has_unfinished_requests() and time.time() < deadline:
            time.sleep(0.01)
        assert not core.has_unfinished_requests()
        assert core.scheduler.kv.pool.num_free_blocks == core.scheduler.kv.num_blocks
    finally:
        llm.shutdown()
