"""`pagedllm bench serve`: load-test any OpenAI-compatible completions endpoint, vLLM's way.

Definitions (as in vLLM's benchmark_serving):
  TTFT  time from sending the request to the first streamed token
  ITL   time between consecutive streamed chunks
  TPOT  (E2EL - TTFT) / (output tokens - 1), per request
  E2EL  time from sending the request to the last chunk
Goodput counts requests meeting every SLO given with --goodput (milliseconds).
Prompts are random token ids (exact lengths, no shared prefixes), sent as token arrays.

``--trace`` sends each request a W3C ``traceparent`` of its own; a server exporting spans
(``pagedllm serve --otlp-traces-endpoint``) puts its ``llm_request`` span in that trace,
so the report's ``slowest_requests`` (with their trace and request ids) lead straight to
the spans that say where the time went (queue, prefill chunks, preemptions).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    ok: bool = False
    error: str = ""
    request_id: str = ""  # the server's response id (the span's gen_ai.request.id, the Chrome trace's slice)
    trace_id: str = ""  # with --trace: the W3C trace id sent in traceparent


def random_dataset(
    num: int, input_len: int, output_len: int, input_ratio: float, output_ratio: float, vocab: int, seed: int
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    lo_in, hi_in = int(input_len * (1 - input_ratio)), int(input_len * (1 + input_ratio))
    lo_out, hi_out = int(output_len * (1 - output_ratio)), int(output_len * (1 + output_ratio))
    out = []
    for _ in range(num):
        n_in, n_out = rng.randint(max(lo_in, 1), max(hi_in, 1)), rng.randint(max(lo_out, 1), max(hi_out, 1))
        out.append(([rng.randrange(100, vocab) for _ in range(n_in)], n_out))
    return out


async def _one(
    client,
    url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    ignore_eos: bool,
    headers: dict,
    trace_rng: random.Random | None = None,
) -> RequestResult:
    res = RequestResult(prompt_len=len(prompt))
    if trace_rng is not None:  # a trace of our own for this request, the server's span its child
        res.trace_id = f"{trace_rng.getrandbits(128) or 1:032x}"
        headers = {**headers, "traceparent": f"00-{res.trace_id}-{trace_rng.getrandbits(64) or 1:016x}-01"}
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                res.request_id = res.request_id or chunk.get("id", "")
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2el = last - start
        res.ok = res.ttft > 0
    except Exception as e:  # a failed request is reported, not fatal
        res.error = repr(e)
    return res


def _stats(values: list[float], prefix: str, percentiles: list[float]) -> dict:
    if not values:
        return {}
    ms = sorted(v * 1000 for v in values)
    out = {
        f"mean_{prefix}_ms": statistics.fmean(ms),
        f"median_{prefix}_ms": statistics.median(ms),
        f"std_{prefix}_ms": statistics.pstdev(ms),
    }
    for p in percentiles:
        k = min(len(ms) - 1, max(0, round(p / 100 * (len(ms) - 1))))
        out[f"p{p:g}_{prefix}_ms"] = ms[k]
    return out


async def run(args: argparse.Namespace) -> dict:
    import httpx

    from pagedllm.entrypoints.graceful_server import client_limits

    data = random_dataset(
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        args.random_output_range_ratio,
        args.vocab_size,
        args.seed,
    )
    url = args.base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    trace_rng = random.Random() if args.trace else None  # ids must not repeat across runs: not seeded
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    limits = client_limits(args.max_concurrency or len(data) or 1)
    from tqdm.auto import tqdm

    bar = tqdm(total=len(data), desc="requests", unit="req")
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:

        async def limited(p, n):
            try:
                if sem is None:
                    return await _one(client, url, args.model, p, n, args.ignore_eos, headers, trace_rng)
                async with sem:
                    return await _one(client, url, args.model, p, n, args.ignore_eos, headers, trace_rng)
            finally:
                bar.update(1)

        if args.num_warmups:  # not timed, not reported: first-use costs (page faults, kernel set-up) come first
            warm = random_dataset(
                args.num_warmups,
                args.random_input_len,
                args.random_output_len,
                args.random_range_ratio,
                args.random_output_range_ratio,
                args.vocab_size,
                args.seed + 1,
            )  # other prompts than the timed ones: no prefix-cache hits
            failed = [
                r.error
                for r in await asyncio.gather(
                    *(_one(client, url, args.model, p, n, args.ignore_eos, headers, None) for p, n in warm)
                )
                if not r.ok
            ]
            if failed:
                raise RuntimeError(f"warm-up request failed: {failed[0]}")
        start = time.perf_counter()
        tasks = []
        for p, n in data:
            tasks.append(asyncio.create_task(limited(p, n)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()

    ok = [r for r in results if r.ok]
    tpots = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    pct = [float(x) for x in args.metric_percentiles.split(",")]
    report = {
        "base_url": args.base_url,
        "model": args.model,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "num_warmups": args.num_warmups,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        **_stats([r.ttft for r in ok], "ttft", pct),
        **_stats(tpots, "tpot", pct),
        **_stats([x for r in ok for x in r.itl], "itl", pct),
        **_stats([r.e2el for r in ok], "e2el", pct),
    }
    if args.goodput:
        slos = dict(item.split(":") for item in args.goodput)
        good = 0
        for r, tpot in zip(ok, [(r.e2el - r.ttft) / max(r.output_tokens - 1, 1) for r in ok]):
            vals = {"ttft": r.ttft, "tpot": tpot, "e2el": r.e2el}
            good += all(vals[k] * 1000 <= float(v) for k, v in slos.items())
        report["request_goodput"] = good / duration
        report["goodput_slos_ms"] = slos
    slowest = sorted(ok, key=lambda r: r.e2el, reverse=True)[: args.slowest]
    report["slowest_requests"] = [
        {
            "request_id": r.request_id,
            **({"trace_id": r.trace_id} if r.trace_id else {}),
            "e2el_ms": r.e2el * 1000,
            "ttft_ms": r.ttft * 1000,
            "prompt_tokens": r.prompt_len,
            "output_tokens": r.output_tokens,
        }
        for r in slowest
    ]
    errors = [r.error for r in results if not r.ok][:5]
    if errors:
        report["first_errors"] = errors
    return report


def add_parser(sub) -> None:
    from pagedllm.entrypoints.cli_args import add_command

    p = add_command(sub, "serve", help="load-test an OpenAI-compatible server (vLLM's metrics)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server to measure")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    p.add_argument("--dataset-name", default="random", choices=["random"], help="random token ids as prompts")
    p.add_argument("--num-prompts", type=int, default=64, help="requests to send")
    p.add_argument("--random-input-len", type=int, default=272, help="mean input length in tokens")
    p.add_argument("--random-output-len", type=int, default=128, help="mean output length in tokens")
    p.add_argument(
        "--random-range-ratio", type=float, default=0.88, help="input lengths are uniform in len * (1 +- ratio)"
    )
    p.add_argument(
        "--random-output-range-ratio", type=float, default=0.0, help="output lengths are uniform in len * (1 +- ratio)"
    )
    p.add_argument("--vocab-size", type=int, default=49152, help="random token ids are drawn below this")
    p.add_argument("--seed", type=int, default=0, help="seed of the dataset and of the arrival times")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson rate (req/s); inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight; default: no limit")
    p.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        help="requests sent at once before the timed run (other random prompts of the same lengths); "
        "not counted in the report",
    )
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask the server to generate every requested token",
    )
    p.add_argument("--goodput", nargs="*", default=None, help="SLOs as ttft:MS tpot:MS e2el:MS")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles to report")
    p.add_argument("--result-file", default=None, help="write the JSON report here")
    p.add_argument(
        "--trace",
        action="store_true",
        help="send each request a W3C traceparent, so the server's spans (--otlp-traces-endpoint) "
        "join the bench's traces; slowest_requests then gives each one's trace id",
    )
    p.add_argument(
        "--slowest",
        type=int,
        default=5,
        help="how many of the slowest requests to list, with their request ids (and trace ids with --trace)",
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from pagedllm.benchmarks.optional import require

    require("pagedllm bench serve", "httpx", "pip install httpx", "to send its requests")
    if args.num_warmups < 0:
        raise SystemExit(f"--num-warmups must be 0 or more, got {args.num_warmups}")
    if args.model is None:
        import httpx

        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        args.model = httpx.get(args.base_url.rstrip("/") + "/v1/models", headers=headers).json()["data"][0]["id"]
    report = asyncio.run(run(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.result_file:
        with open(args.result_file, "w") as f:
            f.write(text)
    return 0 if report["failed"] == 0 else 1
