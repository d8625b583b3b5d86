"""Offline throughput: pagedllm `LLM.generate` vs transformers `generate`, side by side in one run.

Standard workload W64: 64 prompts whose lengths are drawn with random.Random(0).randint(32, 512),
cut by token count from fixed English text at different offsets (no shared prefixes),
128 greedy output tokens each, EOS ignored. transformers runs the same token ids as one
left-padded static batch.

    python benchmarks/throughput.py                       # default model, W64
    python benchmarks/throughput.py --num-prompts 8 --output-len 32 --skip-transformers
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import sys
import time

TEXT = (
    "The history of the river town begins with a ford, a place where the water ran shallow enough for "
    "carts to cross in late summer. Traders came first, then farmers who cleared the slopes for orchards, "
    "and finally the millers who dammed the stream and built the wheels that would turn for two centuries. "
    "Each generation left a layer on the streets: cobbles over gravel, brick over timber, tram rails over "
    "cobbles, and asphalt over everything. Children learned to read in a schoolhouse that had been a "
    "granary; the library was once a customs post, and its reading room still has the iron grille where "
    "tolls were paid. In the floods of the wet years the river climbed the steps of the church and left a "
    "line of silt that no one painted over, so visitors can still see how high it came. Scientists who "
    "study such towns measure the width of the old walls, count the rings of the beams, and compare the "
    "registers of births and burials to reconstruct how many people lived there in each decade. They find "
    "that the population rose when the railway arrived, fell when the mills closed, and rose again when "
    "the town became a place where people from the city wanted to spend their weekends, walking along "
    "the towpath, eating in the old inns, and buying bread from bakeries that use the same ovens as their "
    "great-grandparents did. A careful engineer would note that the bridge was rebuilt three times, that "
    "the dam leaks a little every spring, and that the sluice gates are opened by hand with a wheel that "
    "takes two strong people to turn. Nothing here is fast, and that is exactly why people come."
)


def make_w64(tokenizer, num_prompts: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [rng.randint(min_len, max_len) for _ in range(num_prompts)]
    base = tokenizer.encode(TEXT, add_special_tokens=False)
    prompts = []
    for i, n in enumerate(lengths):
        start = (i * 37) % len(base)  # a different offset per prompt: no shared prefixes
        ids = []
        while len(ids) < n:
            ids += base[start:] + base
            start = 0
        prompts.append(ids[:n])
    return prompts


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_pagedllm(prompts, output_len: int, engine_kwargs: dict) -> dict:
    from pagedllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    tokens = [o.outputs[0].token_ids for o in outs]
    del llm
    gc.collect()
    return {"elapsed_s": elapsed, "outputs": tokens}


def run_transformers(prompts, output_len: int, model_path: str | None, batch_size: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm.model_loader import resolve_model

    src = resolve_model(model_path)
    if src.kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(src.path), gguf_file=os.path.basename(src.path),
                                                     dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32)
    model.eval()
    pad = 0
    t = time.perf_counter()
    outputs = []
    with torch.inference_mode():
        for b in range(0, len(prompts), batch_size):
            batch = prompts[b:b + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=pad)
            outputs += out[:, width:].tolist()
    elapsed = time.perf_counter() - t
    return {"elapsed_s": elapsed, "outputs": outputs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-input-len", type=int, default=32)
    ap.add_argument("--max-input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    from pagedllm.model_loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(args.model))
    prompts = make_w64(tok, args.num_prompts, args.min_input_len, args.max_input_len, args.seed)
    n_prompt = sum(map(len, prompts))
    n_out = args.num_prompts * args.output_len
    kwargs = {"model": args.model}
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    results = {"workload": {"num_prompts": args.num_prompts, "prompt_tokens": n_prompt, "output_tokens": n_out}}
    ours = run_pagedllm(prompts, args.output_len, kwargs)
    results["pagedllm"] = {"elapsed_s": ours["elapsed_s"], "output_tok_s": n_out / ours["elapsed_s"],
                           "total_tok_s": (n_prompt + n_out) / ours["elapsed_s"], "peak_rss_mb": peak_rss_mb()}
    if not args.skip_transformers:
        ref = run_transformers(prompts, args.output_len, args.model, args.hf_batch_size)
        results["transformers"] = {"elapsed_s": ref["elapsed_s"], "output_tok_s": n_out / ref["elapsed_s"],
                                   "total_tok_s": (n_prompt + n_out) / ref["elapsed_s"],
                                   "peak_rss_mb_process": peak_rss_mb()}
        results["ratio_total_tok_s"] = results["pagedllm"]["total_tok_s"] / results["transformers"]["total_tok_s"]
        same = sum(a == b for a, b in zip(ours["outputs"], ref["outputs"]))
        results["greedy_identical_sequences"] = f"{same}/{len(prompts)}"
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
