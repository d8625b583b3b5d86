"""Long prompts on a real-size GGUF, side by side in one command: pagedllm against llama.cpp's server on the same
file, the same prompt tokens and the same threads.

    python benchmarks/long_context.py [--model qwen2.5-coder-1.5b-instruct-q4_k_m | FILE.gguf]
        [--llama-server PATH] [--depths 16384,30720] [--mode gguf] [--kv-cache-dtype bfloat16[,int8]]
        [--document 8192] [--questions 5] [--threads 2] [--out FILE.json]

For each depth, one prompt of that many tokens (this repository's own Python source, which a code model reads
as it reads a user's files) and 64 greedy tokens after it, EOS ignored: the prefill's time and rate, the decode
rate at that depth, the KV cache the context holds, and each engine's peak RSS (its own process's). Then
prefix caching: one document of --document tokens and --questions different questions after it; the first TTFT
pays for the document, the later ones should not (pagedllm's prefix cache; llama.cpp's ``cache_prompt`` reuses
its slot's previous prompt the same way).

Both engines hold a 32,768-token context (the model's own). pagedllm: ``max_model_len=32768``, one sequence,
``--kv-cache-dtype`` (bfloat16 by default: the same 2 bytes a value as llama.cpp's default f16 cache; several,
comma-separated, run one after the other, e.g. ``bfloat16,int8``).
llama.cpp: ``llama-server -c 32768 -np 1`` with its defaults (built as ``benchmarks/real_size.py`` says).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from _servers import start  # beside this script: the folder is on sys.path when it runs
from real_models import resolve, write_report

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = 32768
NEW_TOKENS = 64


def source_text() -> str:
    """This repository's Python source, file by file: real code, about 150 tokens a kilobyte."""
    files = sorted((ROOT / "pagedllm").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    return "".join(f"# file: {f.relative_to(ROOT)}\n{f.read_text()}\n" for f in files)


def prompts(tokenizer, depths: list[int], document: int, questions: int) -> dict:
    """Token ids: one prompt per depth (each begins with its own line, so none shares a cached prefix with
    another), and a document with questions after it."""
    ids = tokenizer.encode(source_text())
    if len(ids) < max([*depths, document]):
        ids = ids * (max([*depths, document]) // len(ids) + 1)
    out: dict = {"depths": {}}
    for d in depths:
        head = tokenizer.encode(f"# A review of {d} tokens of code.\n")
        out["depths"][d] = head + ids[: d - len(head)]
    doc = tokenizer.encode("# The code below is the document for the questions at its end.\n") + ids[:document]
    asks = [
        "Which function builds the engine's scheduler?",
        "Where are the KV cache blocks freed?",
        "What does the sampler do with top_p?",
        "How is a GGUF file's tokenizer loaded?",
        "Which test checks prefix caching?",
        "What limits the number of sequences?",
    ]
    ask = [tokenizer.encode(f"\n# Question: {asks[i % len(asks)]}\n# Answer:") for i in range(questions)]
    out["questions"] = [doc + a for a in ask]
    return out


def kv_bytes_per_token(model: str, kv_cache_dtype: str) -> int:
    """K and V of every layer for one token in a cache of ``kv_cache_dtype`` (pagedllm's names; llama.cpp's f16 is
    ``float16``), from the GGUF's metadata, as pagedllm sizes its blocks."""
    import gguf
    import torch

    from pagedllm.worker.kv_cache import bytes_per_block, resolve_kv_cache_dtype

    reader = gguf.GGUFReader(model)
    arch = str(reader.fields["general.architecture"].contents())

    def meta(key: str) -> int:
        return int(reader.fields[f"{arch}.{key}"].contents())

    head_dim = meta("embedding_length") // meta("attention.head_count")
    dtype = resolve_kv_cache_dtype(kv_cache_dtype, torch.float32)  # 'auto': float32 on CPU
    return bytes_per_block(meta("block_count"), 1, meta("attention.head_count_kv"), head_dim, dtype)


def _pagedllm_child(args: argparse.Namespace) -> None:
    import resource

    from pagedllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        quantization=args.mode,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=CONTEXT,
        max_num_seqs=1,
    )
    out: dict = {"ready_s": time.perf_counter() - t0, "depths": {}, "questions": []}
    work = prompts(llm.get_tokenizer(), args.depths, args.document, args.questions)
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for d, ids in work["depths"].items():
        m = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].metrics
        prefill = m.first_token_time - m.first_scheduled_time
        out["depths"][d] = {
            "prompt_tokens": len(ids),
            "prefill_s": prefill,
            "prefill_tok_s": len(ids) / prefill,
            "decode_tok_s": (NEW_TOKENS - 1) / (m.last_token_time - m.first_token_time),
        }
        print(f"pagedllm depth {d}: {json.dumps(out['depths'][d])}", file=sys.stderr, flush=True)
    for ids in work["questions"]:
        m = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)[0].metrics
        out["questions"].append({"prompt_tokens": len(ids), "ttft_s": m.first_token_time - m.arrival_time})
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps(out))


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def _llama_server(binary: str, model: str, args: argparse.Namespace, work: dict) -> dict:
    cmd = [binary, "-m", model, "-c", str(CONTEXT), "-np", "1", "-t", str(args.threads)]
    out: dict = {"command": " ".join(cmd[:1] + cmd[3:]), "depths": {}, "questions": []}
    t0 = time.perf_counter()
    proc, base_url = start(cmd)  # on a free port, once /health answers
    out["ready_s"] = time.perf_counter() - t0
    try:
        url = f"{base_url}/completion"
        base = {"n_predict": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        for d, ids in work["depths"].items():
            t = _post(url, {**base, "prompt": ids, "cache_prompt": False})["timings"]
            out["depths"][d] = {
                "prompt_tokens": t["prompt_n"],
                "prefill_s": t["prompt_ms"] / 1000,
                "prefill_tok_s": t["prompt_per_second"],
                "decode_tok_s": t["predicted_per_second"],
            }
            print(f"llama.cpp depth {d}: {json.dumps(out['depths'][d])}", file=sys.stderr, flush=True)
        for ids in work["questions"]:
            t0 = time.perf_counter()
            r = _post(url, {"prompt": ids, "n_predict": 1, "temperature": 0, "cache_prompt": True})
            out["questions"].append(
                {"prompt_tokens": len(ids), "ttft_s": time.perf_counter() - t0, "evaluated": r["timings"]["prompt_n"]}
            )
    finally:
        proc.terminate()
        _, _, usage = os.wait4(proc.pid, 0)
    out["peak_rss_gib"] = usage.ru_maxrss / 2**20
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct-q4_k_m")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    p.add_argument("--depths", default="16384,30720", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--mode", default="gguf", help="pagedllm's quantization mode")
    p.add_argument("--kv-cache-dtype", default="bfloat16")
    p.add_argument("--document", type=int, default=8192, help="tokens of the prefix-caching document")
    p.add_argument("--questions", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.depths = [int(d) for d in args.depths.split(",")]
    if any(d + NEW_TOKENS > CONTEXT for d in args.depths) or args.document + 64 > CONTEXT:
        raise SystemExit(f"a depth plus {NEW_TOKENS} new tokens must fit the model's {CONTEXT}-token context")
    if args.child:
        return _pagedllm_child(args)
    from pagedllm.benchmarks.optional import require_program

    server = None
    if args.llama_server:
        fix = "build it as the top of benchmarks/real_size.py says, or leave out --llama-server"
        server = require_program("benchmarks/long_context.py --llama-server", args.llama_server, fix)
    model = str(resolve(args.model))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    dtypes = args.kv_cache_dtype.split(",")
    names = {d: f"pagedllm {args.mode}" if len(dtypes) == 1 else f"pagedllm {args.mode} {d}" for d in dtypes}
    report: dict = {
        "model": model,
        "threads": args.threads,
        "kv_bytes_per_token": {
            "llama.cpp": kv_bytes_per_token(model, "float16"),
            **{names[d]: kv_bytes_per_token(model, d) for d in dtypes},
        },
        "results": {},
    }
    if server:
        from pagedllm.model_loader.resolve import resolve_model
        from pagedllm.model_loader.tokenizer import load_tokenizer

        work = prompts(load_tokenizer(resolve_model(model), None), args.depths, args.document, args.questions)
        report["results"]["llama.cpp"] = _llama_server(server, model, args, work)
    for dtype in dtypes:
        cmd = [sys.executable, __file__, "--child", "--model", model, "--mode", args.mode]
        cmd += ["--kv-cache-dtype", dtype, "--depths", ",".join(map(str, args.depths))]
        cmd += ["--document", str(args.document), "--questions", str(args.questions)]
        out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True).stdout
        report["results"][names[dtype]] = json.loads(out.strip().splitlines()[-1])
    for name, r in report["results"].items():
        per_token = report["kv_bytes_per_token"][name]
        for d, row in r["depths"].items():
            row["kv_gib"] = per_token * int(d) / 2**30
            print(
                f"{name} @ {d}: prefill {row['prefill_s']:.1f} s ({row['prefill_tok_s']:.1f} tok/s), "
                f"decode {row['decode_tok_s']:.2f} tok/s, KV {row['kv_gib']:.2f} GiB"
            )
        ttfts = [q["ttft_s"] for q in r["questions"]]
        if ttfts:
            later = max(ttfts[1:], default=0.0)
            print(f"{name} document: first TTFT {ttfts[0]:.2f} s, later at most {later:.3f} s ({later / ttfts[0]:.1%})")
        print(f"{name}: peak RSS {r['peak_rss_gib']:.2f} GiB")
    write_report(report, args.out)


if __name__ == "__main__":
    main()
