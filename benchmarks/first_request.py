"""A fresh `pagedllm serve`'s first request against its second: what the start-up warm-up is for.

    python benchmarks/first_request.py [--rounds 3] [--first chat] [-- SERVE ARGS...]

Each round starts `pagedllm serve` (the embedded SmolLM2 unless the serve args name a model) on a free port,
waits for /health, then times, one at a time: a /v1/completions request (16 greedy tokens, EOS ignored), the
same request again, and one with other text of the same length; then the same three for /v1/chat/completions
(or chat first, with --first chat: its 34-token prompt takes the batched kernels). A chat request's second
and "new text" runs find most of their prompt (the chat template's system text) in the prefix cache, so they
compute fewer prompt tokens than the first. Prints a line per round and the medians as JSON. The server runs
the `pagedllm` package this interpreter imports (PYTHONPATH included): point it at another checkout to
compare. On a 2-core machine shared with other work, OpenMP's spin-waiting makes a request's time swing by
seconds, most of all a request after an idle gap, the first included; OMP_WAIT_POLICY=PASSIVE (passed on to
the server) steadied them (0.25-0.5 s at a load average of 5) but took an idle machine's 0.15 s to 0.28 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request

from _servers import PAGEDLLM, start, stop

REQUESTS = {
    "completions": ("/v1/completions", lambda w: {"prompt": f"The capital of {w} is"}, ("France", "Spain")),
    "chat": (
        "/v1/chat/completions",
        lambda w: {"messages": [{"role": "user", "content": f"Name a {w}."}]},
        ("colour", "fruit"),
    ),
}


def _post(url: str, body: dict) -> float:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t = time.perf_counter()
    out = json.loads(urllib.request.urlopen(req, timeout=600).read())
    assert out["usage"]["completion_tokens"] == 16, out
    return time.perf_counter() - t


def one_round(serve_args: list[str], order: list[str]) -> dict[str, dict[str, float]]:
    proc, url = start([*PAGEDLLM, "serve", *serve_args])
    try:
        got = {}
        for name in order:
            path, body, (word, other) = REQUESTS[name]
            params = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
            first = _post(url + path, {**body(word), **params})
            second = _post(url + path, {**body(word), **params})
            new_text = _post(url + path, {**body(other), **params})
            got[name] = {"first_s": first, "second_s": second, "new_text_s": new_text}
        return got
    finally:
        stop([proc])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="fresh servers, one after another")
    p.add_argument(
        "--first",
        choices=list(REQUESTS),
        default="completions",
        help="which kind the fresh server answers first (a chat prompt is long enough for the batched kernels)",
    )
    p.add_argument("serve_args", nargs="*", help="passed to `pagedllm serve` (after --)")
    args = p.parse_args()
    order = [args.first, *(k for k in REQUESTS if k != args.first)]
    rounds = []
    for r in range(args.rounds):
        rounds.append(one_round(args.serve_args, order))
        line = "  ".join(
            f"{name}: first {t['first_s']:.2f}s second {t['second_s']:.2f}s new text {t['new_text_s']:.2f}s"
            for name, t in rounds[-1].items()
        )
        print(f"round {r}: {line}", file=sys.stderr, flush=True)
    report: dict = {"rounds": rounds}
    for name in REQUESTS:
        med = {k: statistics.median(r[name][k] for r in rounds) for k in ("first_s", "second_s", "new_text_s")}
        report[name] = {**med, "first_vs_second": med["first_s"] / med["second_s"]}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
