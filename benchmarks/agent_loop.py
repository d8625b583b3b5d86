"""An agent's conversation growing turn by turn on a real-size GGUF, side by side in one command: pagedllm against
llama.cpp's server on the same file, the same prompt tokens and the same threads.

    python benchmarks/agent_loop.py [--model qwen2.5-coder-1.5b-instruct-q4_k_m | FILE.gguf] [--llama-server PATH]
        [--turns 10] [--grow-to 16384] [--threads 2] [--out FILE.json]

An agent resends its whole conversation every turn: a system prompt with its tools' schemas, the user's task, then
per turn the assistant's tool call and the tool's answer (here a file of this repository's code, as a coding agent
reads one). Turn k's prompt is turn k-1's with one more call and answer, so all but the newest part is a prefix the
engine has seen; the chat template (the model's own) writes it. The assistant's turns are fixed text, not what the
model says, so both engines see the same tokens each turn. Per turn: the prompt's tokens, the tokens the engine
computed (the rest came from pagedllm's prefix cache, or from llama.cpp's slot with ``cache_prompt``), and the time
to the first token (a request for one token, timed by the client).

pagedllm: ``max_model_len=32768``, one sequence, prefix caching on (its default), the default quantization, a
bfloat16 KV cache (the 2 bytes a value of llama.cpp's default f16 cache). llama.cpp: ``llama-server -c 32768 -np 1``
with its defaults (built as ``benchmarks/real_size.py`` says).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

from _servers import start  # beside this script: the folder is on sys.path when it runs
from long_context import CONTEXT, _post, source_text
from real_models import resolve, write_report

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite, or the tests matching a pattern.",
            "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}},
        },
    },
]
TASK = (
    "The test that checks prefix caching fails after my last change. Read the scheduler and the block pool, find "
    "why cached blocks are freed too early, and propose a fix."
)


def conversations(tokenizer, turns: int, grow_to: int) -> list[list[int]]:
    """Each turn's prompt token ids: the conversation so far, then the assistant's turn to write."""
    messages: list[dict] = [
        {"role": "system", "content": "You are a careful coding agent. Use the tools to read code before answering."},
        {"role": "user", "content": TASK},
    ]

    def ids() -> list[int]:
        text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    first = ids()
    per_turn = max(64, (grow_to - len(first)) // max(1, turns - 1) - 40)  # the tool's answer; the call ~40 tokens
    code = tokenizer.encode(source_text(), add_special_tokens=False)
    out = [first]
    for k in range(1, turns):
        path = f"pagedllm/part_{k}.py"
        call = {"type": "function", "function": {"name": "read_file", "arguments": {"path": path}}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        answer = tokenizer.decode(code[(k - 1) * per_turn : k * per_turn])
        messages.append({"role": "tool", "name": "read_file", "content": answer})
        out.append(ids())
    return out


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _pagedllm(args: argparse.Namespace, work: list[list[int]]) -> dict:
    from pagedllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, kv_cache_dtype="bfloat16", max_model_len=CONTEXT, max_num_seqs=1)
    out: dict = {"ready_s": time.perf_counter() - t0, "turns": []}
    one = SamplingParams(temperature=0, max_tokens=1)
    for k, ids in enumerate(work):
        t = time.perf_counter()
        result = llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)[0]
        ttft = time.perf_counter() - t
        cached = result.num_cached_tokens or 0
        out["turns"].append({"prompt_tokens": len(ids), "computed": len(ids) - cached, "ttft_s": ttft})
        print(f"pagedllm turn {k + 1}: {json.dumps(out['turns'][-1])}", file=sys.stderr, flush=True)
    del llm  # its memory back before the next engine starts
    return out


def _llama_server(args: argparse.Namespace, work: list[list[int]]) -> dict:
    cmd = [args.llama_server, "-m", args.model, "-c", str(CONTEXT), "-np", "1", "-t", str(args.threads)]
    out: dict = {"command": " ".join(cmd[:1] + cmd[3:]), "turns": []}
    t0 = time.perf_counter()
    proc, base_url = start(cmd)
    out["ready_s"] = time.perf_counter() - t0
    try:
        for k, ids in enumerate(work):
            t = time.perf_counter()
            r = _post(f"{base_url}/completion", {"prompt": ids, "n_predict": 1, "temperature": 0, "cache_prompt": True})
            ttft = time.perf_counter() - t
            out["turns"].append({"prompt_tokens": len(ids), "computed": r["timings"]["prompt_n"], "ttft_s": ttft})
            print(f"llama.cpp turn {k + 1}: {json.dumps(out['turns'][-1])}", file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct-q4_k_m", help="a name in real_models, or a .gguf")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (else pagedllm alone)")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--grow-to", type=int, default=16384, help="about how many tokens the last turn's prompt holds")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here too")
    args = p.parse_args()
    args.model = resolve(args.model)

    from pagedllm.model_loader.resolve import resolve_model
    from pagedllm.model_loader.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(args.model))
    work = conversations(tokenizer, args.turns, args.grow_to)
    report: dict = {
        "model": args.model,
        "threads": args.threads,
        "prompt_tokens": [len(ids) for ids in work],
        "new_each_turn": [len(work[0])] + [len(b) - _shared_prefix(a, b) for a, b in itertools.pairwise(work)],
        "results": {"pagedllm": _pagedllm(args, work)},
    }
    if args.llama_server:
        report["results"]["llama.cpp"] = _llama_server(args, work)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
