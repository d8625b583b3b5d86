"""One stream on a real-size GGUF, side by side in one command: pagedllm's GGUF modes against llama.cpp's
``llama-bench`` (and optionally transformers) on the same file and the same threads.

    python benchmarks/real_size.py [--model qwen2.5-coder-1.5b-instruct-q4_k_m | FILE.gguf]
        [--llama-bench PATH] [--modes gguf,gguf-exact] [--transformers] [--threads 2] [--level avx2] [--rounds 1]

Each engine runs in a process of its own, so its peak RSS (the kernel's ``ru_maxrss`` of that process) is its
own. pagedllm's figures: the start (process start to engine ready, and to the first token of a one-token
request), TTFT of a 128- and a 512-token prompt and decode tok/s over 128 tokens (the request's own
timestamps, medians of --iters after a warm-up). llama.cpp's: ``llama-bench -p 128,512 -n 128`` (its pp rate
turned into a TTFT: prompt tokens / rate), llama.cpp built from the ``llama-cpp-python`` sdist's vendored tree:

    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/vendor/llama.cpp && cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \\
        && cmake --build build -j2 --target llama-bench llama-server

``--level`` runs pagedllm's kernels at that instruction-set level (``$PAGEDLLM_CPU_LEVEL``: portable, avx2,
avx2-vnni, avx512-vnni, avx512-bf16, amx; default the machine's best), and below AVX-512 torch's own kernels and
oneDNN's GEMM at that level too (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``); the peer at the same level is
llama.cpp built for it without ``GGML_NATIVE`` (a native build may also die on a VM that advertises AMX and traps
it, and its AMX kernels crashed on one that grants it: ``--llama-args "--repack 0"`` runs it without them), e.g. AVX2:

    cmake -B build-avx2 -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
        -DGGML_BMI2=ON -DGGML_AVX512=OFF -DLLAMA_CURL=OFF  (add -DGGML_AVX_VNNI=ON for avx2-vnni)

``--rounds N`` runs llama.cpp and each mode N times in turn (llama.cpp, the modes, llama.cpp, the modes, ...) and
reports each figure's median over the rounds and each ratio's median over the rounds' ratios: a machine whose speed
drifts from one minute to the next (a shared host) then slows both sides of most ratios, where a single round can
catch llama.cpp in a fast stretch and pagedllm in a slow one.

Prints a table and JSON. Models named as in ``benchmarks/real_models.py`` are fetched (and checked) first.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

from real_models import resolve  # beside this script: the folder is on sys.path when it runs


def _run(cmd: list[str], env: dict[str, str] | None = None) -> tuple[str, int]:
    """Run ``cmd``; its stdout and its own peak RSS in bytes."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{cmd[:4]} … failed with exit code {proc.returncode}")
    return out, usage.ru_maxrss * 1024


def _child(args: argparse.Namespace) -> None:
    """One pagedllm mode in this process: start, TTFTs, decode rate (JSON on stdout)."""
    t0 = time.perf_counter()
    import statistics

    from pagedllm import LLM, SamplingParams

    kw = {} if args.mode == "default" else {"quantization": args.mode}
    llm = LLM(model=args.model, max_model_len=2048, max_num_seqs=8, enable_prefix_caching=False, **kw)
    ready = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()
    text = " ".join(words[i % len(words)] for i in range(2000))
    ids = tok.encode(text)
    first = llm.generate([{"prompt_token_ids": ids[:8]}], SamplingParams(max_tokens=1), use_tqdm=False)
    first_token = time.perf_counter() - t0
    del first
    out: dict[str, float] = {"ready_s": ready, "first_token_s": first_token}
    for n_in in (128, 512):
        ttfts = []
        for i in range(args.iters + 1):
            sp = SamplingParams(temperature=0, max_tokens=1)
            o = llm.generate([{"prompt_token_ids": ids[i : i + n_in]}], sp, use_tqdm=False)[0]
            m = o.metrics
            assert m is not None and m.first_token_time is not None
            if i:
                ttfts.append(m.first_token_time - m.arrival_time)
        out[f"ttft_{n_in}_ms"] = statistics.median(ttfts) * 1000
    rates = []
    for i in range(args.iters + 1):
        sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        o = llm.generate([{"prompt_token_ids": ids[i : i + 128]}], sp, use_tqdm=False)[0]
        m = o.metrics
        assert m is not None and m.first_token_time is not None and m.last_token_time is not None
        if i:
            rates.append(127 / (m.last_token_time - m.first_token_time))
    out["decode_tok_s"] = statistics.median(rates)
    print(json.dumps(out))


def _transformers_child(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    import statistics

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(args.model), gguf_file=os.path.basename(args.model), dtype=torch.float32
    ).eval()
    ready = time.perf_counter() - t0
    ids = torch.randint(1000, 20000, (1, 512), generator=torch.Generator().manual_seed(0))
    out: dict[str, float] = {"ready_s": ready}
    with torch.inference_mode():
        for n_in in (128, 512):
            times = []
            for _ in range(args.iters):
                t = time.perf_counter()
                model(ids[:, :n_in])
                times.append(time.perf_counter() - t)
            out[f"ttft_{n_in}_ms"] = statistics.median(times) * 1000
        t = time.perf_counter()
        model.generate(ids[:, :128], max_new_tokens=33, min_new_tokens=33, do_sample=False, pad_token_id=0)
        total = time.perf_counter() - t
    out["decode_tok_s"] = 32 / (total - out["ttft_128_ms"] / 1000)
    print(json.dumps(out))


def _llama_bench(binary: str, model: str, threads: int, iters: int, extra: list[str]) -> tuple[dict[str, float], int]:
    out, rss = _run(
        [binary, "-m", model, "-t", str(threads), "-p", "128,512", "-n", "128", "-r", str(iters), "-o", "json", *extra]
    )
    rows = json.loads(out)
    got: dict[str, float] = {}
    for r in rows:
        if r["n_prompt"] and not r["n_gen"]:
            got[f"ttft_{r['n_prompt']}_ms"] = r["n_prompt"] / r["avg_ts"] * 1000
        elif r["n_gen"] and not r["n_prompt"]:
            got["decode_tok_s"] = r["avg_ts"]
    return got, rss


FIGURES = ("ttft_128_ms", "ttft_512_ms", "decode_tok_s", "peak_rss_gib", "ready_s", "first_token_s")
RATIOS = FIGURES[:4]  # against llama.cpp's, which has no start-up figures


def summary(
    rounds: list[dict[str, dict[str, float]]],
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, list[float]]]]:
    """The rounds' results (engine -> figure -> value, one dict a round) as each engine's median of each figure,
    and each engine's ratios to llama.cpp's figures of the same round (figure -> one ratio a round that had both)."""
    medians: dict[str, dict[str, float]] = {}
    ratios: dict[str, dict[str, list[float]]] = {}
    for name in dict.fromkeys(n for r in rounds for n in r):  # first seen, first listed
        runs = [r[name] for r in rounds if name in r]
        medians[name] = {}
        for c in FIGURES:
            if values := [run[c] for run in runs if c in run]:
                medians[name][c] = statistics.median(values)
        if name == "llama.cpp":
            continue
        pairs = [(r[name], r["llama.cpp"]) for r in rounds if name in r and "llama.cpp" in r]
        if pairs:
            ratios[name] = {c: [got[c] / ref[c] for got, ref in pairs if c in got and c in ref] for c in RATIOS}
    return medians, ratios


# what torch's own kernels (ATen) and oneDNN's GEMM may use at a pagedllm level below AVX-512 (each dispatches
# to the best the CPU has otherwise: a float32 GEMM ran AVX-512 under --level avx2, 1.8x the AVX2 speed here)
TORCH_ISA = {
    "portable": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx2-vnni": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct-q4_k_m")
    p.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary")
    p.add_argument(
        "--llama-args",
        default="",
        help="more arguments for llama-bench, e.g. '--repack 0' (its AMX kernels crash on some CPUs)",
    )
    p.add_argument("--modes", default="gguf,gguf-exact", help="pagedllm quantization modes, comma-separated")
    p.add_argument("--transformers", action="store_true", help="also transformers (float32, dequantized)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="each engine this many times, in turn; medians (see above)")
    p.add_argument("--level", default=None, help="pagedllm's kernel level ($PAGEDLLM_CPU_LEVEL); default the best")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="default", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child == "pagedllm":
        return _child(args)
    if args.child == "transformers":
        return _transformers_child(args)
    # what the optional engines need, before a model is fetched or loaded
    from pagedllm.benchmarks.optional import BENCH_EXTRA, require, require_program

    if args.transformers:
        require("benchmarks/real_size.py --transformers", "accelerate", BENCH_EXTRA, "to load a GGUF in transformers")
    llama_bench = None
    if args.llama_bench:
        fix = "build it as the top of benchmarks/real_size.py says, or leave out --llama-bench"
        llama_bench = require_program("benchmarks/real_size.py --llama-bench", args.llama_bench, fix)
    if args.level:
        from pagedllm.kernels import isa

        os.environ[isa.ENV] = args.level
        isa.chosen_level()  # a level this machine cannot run fails here, before anything is fetched
        os.environ.update(TORCH_ISA.get(args.level, {}))  # torch's own kernels, oneDNN's GEMM, at that level too
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    model = resolve(args.model)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    rounds: list[dict[str, dict[str, float]]] = []

    def done(name: str, got: dict[str, float]) -> None:  # at once: an engine after it that fails cannot lose it
        rounds[-1][name] = got
        tag = f"round {len(rounds)}: " if args.rounds > 1 else ""
        print(f"{tag}{name}: {json.dumps(got)}", file=sys.stderr, flush=True)

    # the kernels compiled for the level (if not cached) in a process of its own: a build inside a measured one would
    # count the compiler's memory in its peak RSS (wait4's counts reaped children) and its seconds in ready_s
    subprocess.run([sys.executable, "-c", "from pagedllm import kernels; kernels.load()"], env=env, check=True)
    for k in range(args.rounds):
        rounds.append({})
        if llama_bench:
            got, rss = _llama_bench(llama_bench, model, args.threads, args.iters, shlex.split(args.llama_args))
            done("llama.cpp", {**got, "peak_rss_gib": rss / 2**30})
        for mode in args.modes.split(","):
            cmd = [sys.executable, __file__, "--child", "pagedllm", "--mode", mode, "--model", model]
            out, rss = _run([*cmd, "--iters", str(args.iters)], env)
            done(f"pagedllm {mode}", {**json.loads(out.strip().splitlines()[-1]), "peak_rss_gib": rss / 2**30})
        if args.transformers and not k:  # its float32 run is minutes, and far from every ratio that is close
            cmd = [sys.executable, __file__, "--child", "transformers", "--model", model, "--iters", str(args.iters)]
            out, rss = _run(cmd, env)
            done("transformers", {**json.loads(out.strip().splitlines()[-1]), "peak_rss_gib": rss / 2**30})
    results, ratios = summary(rounds)
    level = f", pagedllm's kernels at the {args.level} level" if args.level else ""
    medians = f", medians of {args.rounds} rounds" if args.rounds > 1 else ""
    print(f"{os.path.basename(model)}, {args.threads} threads{level}{medians}")
    print("| engine | " + " | ".join(FIGURES) + " |")
    print("|---" * (len(FIGURES) + 1) + "|")
    for name, r in results.items():
        print(f"| {name} | " + " | ".join(f"{r[c]:.2f}" if c in r else "–" for c in FIGURES) + " |")
    for name, by in ratios.items():
        ratio = {c: statistics.median(v) if v else float("nan") for c, v in by.items()}
        print(
            f"{name}: decode {ratio['decode_tok_s']:.2f}x llama.cpp, TTFT 128 {ratio['ttft_128_ms']:.2f}x, "
            f"TTFT 512 {ratio['ttft_512_ms']:.2f}x, peak RSS {ratio['peak_rss_gib']:.2f}x"
            + (" (medians of the rounds' ratios)" if args.rounds > 1 else "")
        )
        if args.rounds > 1:
            for c, v in by.items():
                print(f"  {c}: " + " ".join(f"{x:.2f}" for x in v))
    print(json.dumps({"model": model, "threads": args.threads, "results": results, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
