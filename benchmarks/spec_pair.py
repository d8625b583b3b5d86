"""Speculative decoding with a real draft: Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B, both as stored.

    python benchmarks/spec_pair.py [--target qwen2.5-coder-1.5b-instruct-q4_k_m] \\
        [--draft qwen2.5-coder-0.5b-instruct] [--ks 2,4,6] [--ngram-k 4] [--max-tokens 192] \\
        [--quantization gguf] [--draft-quantization gguf] [--backoff-by-cost on|off|both] \\
        [--adaptive-length on|off|both] [--ngram-first on|off|both] [--rounds N]

One stream, greedy, three workloads (chat prompts through the target's template):

- ``completion``: function bodies from signatures and docstrings;
- ``editing``: the user's code repeated with a small change (copy-heavy);
- ``chat``: an explanation in prose.

For each configuration (no speculation; n-gram with k = --ngram-k; the draft model with each k of --ks) one
engine runs the three workloads after a warm-up (with --rounds N, every engine is loaded at once and each
workload answered by each engine in turn, N times, medians reported: it cancels the machine's drift): decode
tok/s (the request's own timestamps, first token to last), the speed-up over no speculation in the same
command, whether the tokens equal no speculation's (they must: greedy), the acceptance rate, mean accepted
length and acceptance per draft position.
Models named as in ``benchmarks/real_models.py`` are fetched (and checked) first. Prints a table and JSON.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

from real_models import resolve, write_report  # beside this script: the folder is on sys.path when it runs

EDIT_SOURCE = """import csv
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    quantity: int


def load(path):
    items = []
    with open(path) as f:
        for row in csv.DictReader(f):
            items.append(Item(row["name"], float(row["price"]), int(row["quantity"])))
    return items


def compute(items):
    total = 0.0
    for item in items:
        total += item.price * item.quantity
    return total


def cheapest(items):
    return min(items, key=lambda item: item.price)


if __name__ == "__main__":
    items = load("items.csv")
    print(compute(items), cheapest(items).name)
"""

WORKLOADS = {
    "completion": (
        "Complete this Python function. Answer with the whole function in one code block.\n\n"
        "def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:\n"
        '    """Merge overlapping intervals; return them sorted by start."""\n'
    ),
    "editing": (
        "Rename the function `compute` to `total_price` everywhere in this file and answer with the whole "
        f"updated file in one code block, nothing else.\n\n```python\n{EDIT_SOURCE}```"
    ),
    "chat": "Explain the difference between a process and a thread to a new programmer, in one paragraph.",
}


def _engine(target: str, spec: dict | None, quantization: str | None):
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.offline import spec_report

    kwargs = {"speculative_config": spec} if spec else {}
    if quantization:
        kwargs["quantization"] = quantization
    llm = LLM(target, max_model_len=2048, max_num_seqs=4, enable_prefix_caching=False, **kwargs)
    llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    spec_report(llm)  # counts from here on
    return llm


def _answer(llm, prompt: str, max_tokens: int) -> tuple[list[int], float]:
    """One workload's greedy answer: (its tokens, decode tok/s from the first token to the last)."""
    from pagedllm import SamplingParams

    ids = llm.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    (res,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    m, n = res.metrics, len(res.outputs[0].token_ids)
    return res.outputs[0].token_ids, (n - 1) / (m.last_token_time - m.first_token_time)


def _run_all(target: str, configs: dict, max_tokens: int, quantization: str | None, rounds: int) -> dict:
    """Each configuration's results: one engine after another (rounds 1), or every engine loaded at once and
    each workload answered by each in turn, ``rounds`` times (the median rate): this machine's speed drifts
    by several per cent between minutes, which interleaving cancels out of the ratios."""
    from pagedllm.benchmarks.offline import spec_report

    results: dict = {}
    if rounds == 1:
        for name, spec in configs.items():
            llm = _engine(target, spec, quantization)
            results[name] = {}
            for work, prompt in WORKLOADS.items():
                tokens, rate = _answer(llm, prompt, max_tokens)
                results[name][work] = {"tokens": tokens, "decode_tok_s": rate, "spec": spec_report(llm)}
            del llm
            gc.collect()
        return results
    engines = {name: _engine(target, spec, quantization) for name, spec in configs.items()}
    results = {name: {work: {"rates": []} for work in WORKLOADS} for name in engines}
    for _ in range(rounds):
        for work, prompt in WORKLOADS.items():
            for name, llm in engines.items():
                r = results[name][work]
                r["tokens"], rate = _answer(llm, prompt, max_tokens)
                r["rates"].append(rate)
    for name, llm in engines.items():  # acceptance over all rounds
        spec = spec_report(llm)
        for work in WORKLOADS:
            r = results[name][work]
            r["decode_tok_s"], r["spec"] = statistics.median(r["rates"]), spec
    return results


def _variants(configs: dict, mode: str, default: str, suffix: str, change: dict) -> dict:
    """Each speculative config as it is (mode == default), changed (the other one), or both (mode "both")."""
    if mode == default:
        return configs
    out: dict[str, dict | None] = {}
    for name, spec in configs.items():
        if spec is None or mode == "both":
            out[name] = spec
        if spec is not None:
            out[f"{name} {suffix}"] = {**spec, **change}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct-q4_k_m")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--ks", default="2,4,6", help="the draft model's num_speculative_tokens values")
    ap.add_argument("--ngram-k", type=int, default=4, help="n-gram's num_speculative_tokens (0: no n-gram run)")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--quantization", default=None, help="the target's, e.g. gguf (default: the file's own blocks)")
    ap.add_argument("--draft-quantization", default=None, help="speculative_config.quantization, e.g. gguf")
    ap.add_argument(
        "--backoff-by-cost",
        choices=("on", "off", "both"),
        default="on",
        help="speculative_config.backoff_by_cost of every speculative run; both: each run with it and without",
    )
    ap.add_argument(
        "--adaptive-length",
        choices=("on", "off", "both"),
        default="off",
        help="speculative_config.adaptive_length of every speculative run; both: each run with it and without",
    )
    ap.add_argument(
        "--ngram-first",
        choices=("on", "off", "both"),
        default="off",
        help="speculative_config.ngram_first of every draft-model run (the prompt lookup drafts first, the draft "
        "model where it finds nothing); both: each draft-model run with it and without",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="load every configuration's engine at once and answer each workload this many times in turn "
        "(medians; acceptance then counts all rounds together)",
    )
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    target, draft = resolve(args.target), resolve(args.draft)
    configs: dict[str, dict | None] = {"off": None}
    if args.ngram_k:
        configs[f"ngram k={args.ngram_k}"] = {"method": "ngram", "num_speculative_tokens": args.ngram_k}
    for k in (int(x) for x in args.ks.split(",") if x):
        configs[f"draft k={k}"] = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
        if args.draft_quantization:
            configs[f"draft k={k}"]["quantization"] = args.draft_quantization
        if args.ngram_first != "off":
            spec = configs.pop(f"draft k={k}") if args.ngram_first == "on" else configs[f"draft k={k}"]
            configs[f"draft+lookup k={k}"] = {**spec, "ngram_first": True}
    configs = _variants(configs, args.backoff_by_cost, "on", "no-cost", {"backoff_by_cost": False})
    configs = _variants(configs, args.adaptive_length, "off", "adaptive", {"adaptive_length": True})

    started = time.perf_counter()
    results = _run_all(target, configs, args.max_tokens, args.quantization, args.rounds)
    base = results["off"]
    report: dict = {
        "target": Path(target).name,
        "draft": Path(draft).name,
        "quantization": args.quantization,
        "draft_quantization": args.draft_quantization,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "runs": {},
    }
    print(
        f"{'config':20} {'workload':11} {'tokens':>6} {'tok/s':>7} {'speed-up':>8} {'same':>5} {'accept':>6} {'len':>5}"
    )
    for name, res in results.items():
        report["runs"][name] = {}
        for work, r in res.items():
            spec = r["spec"] or {}
            row = {
                "tokens": len(r["tokens"]),
                "decode_tok_s": round(r["decode_tok_s"], 2),
                "speedup_each_round": [round(x / base[work]["decode_tok_s"], 3) for x in r.get("rates", ())],
                "speedup": round(r["decode_tok_s"] / base[work]["decode_tok_s"], 3),
                "identical_to_off": r["tokens"] == base[work]["tokens"],
                "acceptance_rate": spec.get("acceptance_rate"),
                "mean_accepted_length": spec.get("mean_accepted_length"),
                "acceptance_per_position": spec.get("acceptance_per_position"),
            }
            report["runs"][name][work] = row
            acc = f"{row['acceptance_rate']:.2f}" if row["acceptance_rate"] is not None else "-"
            mal = f"{row['mean_accepted_length']:.2f}" if row["mean_accepted_length"] is not None else "-"
            print(
                f"{name:20} {work:11} {row['tokens']:6d} {row['decode_tok_s']:7.2f} {row['speedup']:7.2f}x "
                f"{row['identical_to_off']!s:>5} {acc:>6} {mal:>5}"
            )
    report["seconds"] = round(time.perf_counter() - started, 1)
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
