"""llama.cpp side by side with pagedllm's int4 modes on the same GGUF, in one command.

    python benchmarks/vs_llama_cpp.py [--model FILE.gguf] [--num-prompts 8] [--output-len 128] [--threads 2]

Needs llama.cpp's Python binding, which builds llama.cpp from source (about 25 minutes on 2 cores);
it is not one of pagedllm's dependencies:

    CMAKE_ARGS="-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DGGML_NATIVE=ON" \\
        pip install --no-deps llama-cpp-python diskcache

Two questions, each answered for llama.cpp (its own CPU kernels: Q4_1 weights times activations
rounded to Q8_1 per group of 32) and for pagedllm `w4a8` (the same arithmetic) and `w4a16`:

* fidelity, on `bench accuracy`'s prompts against pagedllm float32 (the GGUF's weights dequantized
  exactly, which greedy-matches transformers): greedy agreement (tokens before each sequence's first
  divergence) and same top token (the fraction of positions along float32's greedy continuations
  where both rank the same token first);
* one stream, as `bench latency` measures it: a 128-token prompt, then --output-len greedy tokens:
  time to first token and decode tok/s, medians of --num-iters after one warm-up run, with
  --threads threads for llama.cpp.

Prints JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time


def _llama(path: str, threads: int, logits_all: bool = False):
    from llama_cpp import Llama

    return Llama(
        model_path=path,
        n_ctx=2048,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=logits_all,
        verbose=False,
    )


def _llama_greedy(lc, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    """n greedy tokens after prompt; (tokens, seconds to the first, seconds in all)."""
    lc.reset()
    out: list[int] = []
    t0 = time.perf_counter()
    first = 0.0
    for t in lc.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(t))
        if len(out) == 1:
            first = time.perf_counter() - t0
        if len(out) == n:
            break
    return out, first, time.perf_counter() - t0


def _llama_tops(lc, prompt: list[int], continuation: list[int]) -> list[int]:
    """llama.cpp's first-ranked token at each position of continuation, reading prompt + continuation."""
    import numpy as np

    lc.reset()
    lc.eval(prompt + continuation)
    scores = np.asarray(lc.scores[len(prompt) - 1 : len(prompt) - 1 + len(continuation)])
    return scores.argmax(axis=1).tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2 Q4_1)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise SystemExit("this benchmark needs llama-cpp-python (see the top of benchmarks/vs_llama_cpp.py)") from None

    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.offline import greedy_agreement, make_w64, run_latency, same_top_token, teacher_forced_tops
    from pagedllm.model_loader import load_tokenizer, resolve_model

    src = resolve_model(args.model)
    if not src.path.endswith(".gguf"):
        raise SystemExit(f"--model must be a GGUF file for llama.cpp, got {src.path}")
    tok = load_tokenizer(src)
    prompts = make_w64(tok, args.num_prompts, 32, 512, 1)  # bench accuracy's prompts
    timed = make_w64(tok, 1, 128, 128, 0)[0]  # bench latency's prompt
    n = args.output_len
    outs: dict[str, list[list[int]]] = {}
    tops: dict[str, list[list[int]]] = {}
    speed: dict[str, dict] = {}

    modes = (("float32", "gguf-exact"), ("w4a8", "w4a8"), ("w4a16", "w4a16"))  # gguf-exact: float32's function
    for name, kwargs in ((name, {"quantization": q}) for name, q in modes):
        llm = LLM(model=src.path, enable_prefix_caching=False, max_num_batched_tokens=512, **kwargs)
        greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        outs[name] = [
            o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": q} for q in prompts], greedy, use_tqdm=False)
        ]
        tops[name] = teacher_forced_tops(llm, prompts, outs["float32"])
        del llm
        gc.collect()
        if name != "float32":  # bench latency's measurement: the request's own timestamps
            lat = run_latency(src.path, len(timed), n, args.num_iters, 1, "pagedllm", kwargs)
            speed[name] = {"ttft_ms": lat["median_ttft_ms"], "decode_tok_s": lat["median_decode_tok_s"]}

    lc = _llama(src.path, args.threads)
    outs["llama.cpp"] = [_llama_greedy(lc, q, n)[0] for q in prompts]
    _llama_greedy(lc, timed, n)
    runs = [_llama_greedy(lc, timed, n)[1:] for _ in range(args.num_iters)]
    speed["llama.cpp"] = {
        "ttft_ms": statistics.median(first for first, _ in runs) * 1000,
        "decode_tok_s": statistics.median((n - 1) / (total - first) for first, total in runs),
    }
    del lc
    gc.collect()
    lc = _llama(src.path, args.threads, logits_all=True)
    tops["llama.cpp"] = [_llama_tops(lc, q, c) for q, c in zip(prompts, outs["float32"])]
    del lc

    report = {
        "model": src.path,
        "num_prompts": args.num_prompts,
        "output_len": n,
        "threads": args.threads,
        "vs_float32": {
            k: {
                **greedy_agreement(outs["float32"], outs[k]),
                "same_top_token": same_top_token(tops["float32"], tops[k]),
            }
            for k in ("llama.cpp", "w4a8", "w4a16")
        },
        "llama.cpp_vs_w4a8": greedy_agreement(outs["w4a8"], outs["llama.cpp"]),
        "one_stream": speed,
        "decode_vs_llama.cpp": {
            k: speed[k]["decode_tok_s"] / speed["llama.cpp"]["decode_tok_s"] for k in ("w4a8", "w4a16")
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
