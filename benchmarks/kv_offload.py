"""What the RAM tier buys: documents asked about twice, with a primary KV cache far too small to keep them.

    python benchmarks/kv_offload.py [--num-docs 32] [--doc-len 1500] [--kv-cache-memory-mb 200]
                                    [--kv-offloading-size 4] [--model MODEL]

Runs the same workload twice in one process, without and with ``kv_offloading_size``: a first pass
that asks one question about each document, then a second pass with another question about each. The
questions go one at a time, so a request's TTFT is its own prefill (no queueing). Reports, per run,
the prompt tokens the second pass recomputed (counted by the model runner) and the median TTFT of each
pass, and checks that both runs produced the same tokens. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pagedllm import LLM, SamplingParams


def run(args: argparse.Namespace, docs: list[list[int]], questions: list[list[list[int]]], **kw) -> dict:
    llm = LLM(model=args.model, kv_cache_memory=args.kv_cache_memory_mb << 20, max_model_len=args.doc_len + 64, **kw)
    runner = llm.llm_engine.core.runner
    params = SamplingParams(temperature=0, max_tokens=1)
    out: dict = {"tokens": []}
    for name, qs in zip(("first", "second"), questions):
        before = runner.num_tokens_computed
        ttfts = []
        for doc, q in zip(docs, qs):
            t0 = time.perf_counter()
            o = llm.generate([{"prompt_token_ids": doc + q}], params, use_tqdm=False)[0]
            ttfts.append(time.perf_counter() - t0)
            out["tokens"].append(o.outputs[0].token_ids)
        out[f"{name}_pass_computed_prompt_tokens"] = runner.num_tokens_computed - before
        out[f"{name}_pass_median_ttft_s"] = round(statistics.median(ttfts), 4)
    stats = llm.llm_engine.core.make_stats()
    if stats.kv_connector is not None:
        out["tier"] = {
            "hits": stats.kv_connector.hits,
            "queries": stats.kv_connector.queries,
            "ram_bytes_saved": stats.kv_connector.ram_bytes_saved,
            "ram_bytes_loaded": stats.kv_connector.ram_bytes_loaded,
            "save_seconds": round(stats.kv_connector.save_seconds, 3),
            "load_seconds": round(stats.kv_connector.load_seconds, 3),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--num-docs", type=int, default=32)
    p.add_argument("--doc-len", type=int, default=1500)
    p.add_argument("--kv-cache-memory-mb", type=int, default=200)
    p.add_argument("--kv-offloading-size", type=float, default=4.0, help="GiB")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    docs = [[rng.randrange(100, 40000) for _ in range(args.doc_len)] for _ in range(args.num_docs)]
    questions = [[[rng.randrange(100, 40000) for _ in range(12)] for _ in docs] for _ in range(2)]
    prompt_tokens = sum(len(d) + 12 for d in docs)
    plain = run(args, docs, questions)
    tiered = run(args, docs, questions, kv_offloading_size=args.kv_offloading_size)
    same = plain.pop("tokens") == tiered.pop("tokens")
    cut = 1 - tiered["second_pass_computed_prompt_tokens"] / plain["second_pass_computed_prompt_tokens"]
    print(
        json.dumps(
            {
                "num_docs": args.num_docs,
                "doc_len": args.doc_len,
                "second_pass_prompt_tokens": prompt_tokens,
                "no_offloading": plain,
                "ram_tier": tiered,
                "same_tokens": same,
                "recomputed_prompt_tokens_cut": round(cut, 4),
                "second_pass_median_ttft_ratio": round(
                    plain["second_pass_median_ttft_s"] / tiered["second_pass_median_ttft_s"], 2
                ),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
