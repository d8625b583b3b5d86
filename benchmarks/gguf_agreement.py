"""How close each engine's greedy tokens on a GGUF come to the float32 function of the same weights: pagedllm's
``gguf`` mode (int8 activations, the file's blocks as stored) and llama.cpp (``llama-server``, greedy, its own
kernels), each against pagedllm's ``gguf-exact`` (float32 activations times the weights gguf dequantizes to,
equal to ``quantization='none'`` within 2e-5 in logprob).

    python benchmarks/gguf_agreement.py --llama-server PATH FILE.gguf [FILE.gguf ...] [--tokens 48]

Four chat prompts, their token ids from the model's own chat template, the same ids sent to both engines
(``/completion`` with a token-id prompt, ``temperature 0``, ``top_k 1``, ``n_probs 5``, EOS ignored). Per file and
engine: how many of the four sequences equal the reference token for token; where one parts, the position,
whether each side's token is in the other's top 5 (the project's rule for greedy agreement), and the reference's
logprob gap between the two tokens; and the largest logprob difference of a chosen token before any parting.
Prints one JSON line per file.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import urllib.request
from typing import Any

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash map is in two sentences.",
    "def quicksort(xs):",
    "List three differences between TCP and UDP.",
]

# one generated sequence: its token ids, and per position {token id: logprob} of the top candidates
Sequence = tuple[list[int], list[dict[int, float]]]


def _pagedllm(path: str, mode: str | None, tokens: int) -> tuple[list[list[int]], list[Sequence]]:
    from pagedllm import LLM, SamplingParams

    llm = LLM(path, max_model_len=1024, **({"quantization": mode} if mode else {}))
    ids = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    sp = SamplingParams(temperature=0, max_tokens=tokens, logprobs=5, ignore_eos=True)
    seqs: list[Sequence] = []
    for o in llm.generate([{"prompt_token_ids": i} for i in ids], sp, use_tqdm=False):
        out = o.outputs[0]
        assert out.logprobs is not None
        seqs.append((list(out.token_ids), [{t: lp.logprob for t, lp in d.items()} for d in out.logprobs]))
    del llm
    gc.collect()
    return ids, seqs


def _llama_server(server: str, path: str, ids: list[list[int]], tokens: int, threads: int) -> list[Sequence]:
    from _servers import start, stop  # beside this script: the folder is on sys.path when it runs

    proc, url = start([server, "-m", path, "-t", str(threads), "-c", "2048", "-np", "1", "--no-warmup"])
    try:
        seqs: list[Sequence] = []
        for prompt in ids:
            body = {
                "prompt": prompt,
                "n_predict": tokens,
                "temperature": 0,
                "top_k": 1,
                "n_probs": 5,
                "cache_prompt": False,
                "ignore_eos": True,
            }
            req = urllib.request.Request(
                f"{url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            steps: list[dict[str, Any]] = json.loads(urllib.request.urlopen(req, timeout=900).read())[
                "completion_probabilities"
            ]
            seqs.append(([s["id"] for s in steps], [{t["id"]: t["logprob"] for t in s["top_logprobs"]} for s in steps]))
        return seqs
    finally:
        stop([proc])


def compare(ref: list[Sequence], other: list[Sequence], k: int = 5) -> dict[str, Any]:
    """Sequences equal to the reference; per sequence None or [position, each token in the other's top k, the
    reference's logprob gap]; the largest |logprob difference| of a chosen token before any parting."""
    same, parts, most = 0, [], 0.0
    for (ref_ids, ref_lps), (ids, lps) in zip(ref, other):
        part = None
        for pos, (a, b) in enumerate(zip(ref_ids, ids)):
            la, lb = ref_lps[pos], lps[pos]
            if a == b:
                if a in la and a in lb:
                    most = max(most, abs(la[a] - lb[a]))
                continue
            top_a = sorted(la, key=la.__getitem__, reverse=True)[:k]
            top_b = sorted(lb, key=lb.__getitem__, reverse=True)[:k]
            part = [pos, b in top_a and a in top_b, round(la[a] - la.get(b, -math.inf), 3)]
            break
        same += part is None
        parts.append(part)
    return {"identical": f"{same} of {len(ref)}", "partings": parts, "max_logprob_diff": round(most, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="GGUF files")
    ap.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2, help="llama-server's threads")
    args = ap.parse_args()
    for path in args.files:
        ids, ref = _pagedllm(path, "gguf-exact", args.tokens)
        _, ours = _pagedllm(path, None, args.tokens)
        theirs = _llama_server(args.llama_server, path, ids, args.tokens, args.threads)
        print(json.dumps({"file": path, "pagedllm gguf": compare(ref, ours), "llama.cpp": compare(ref, theirs)}))


if __name__ == "__main__":
    main()
