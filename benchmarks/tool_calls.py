"""How often a real model's tool calls are taken, and how often an ordinary answer is taken for one.

    python benchmarks/tool_calls.py [--model qwen2.5-coder-1.5b-instruct-q4_k_m | FILE.gguf] [--parser hermes]

The model answers four sets of chat questions greedily with tools offered (a weather and a time tool), through
``LLM.chat(..., tools=)`` and the server's own parser (``--tool-call-parser``, bound to the tools as the server
binds it per request):

- ``one_call``: questions a tool answers: each should give one valid call;
- ``two_calls``: two cities in one question: parallel calls where the model writes them;
- ``no_tool``: questions no tool helps with: each should stay text;
- ``json_answer``: the user asks for JSON (records, configs, even weather-shaped data) with the tools offered:
  each should stay text; a call here is a false positive.

Prints one line per question (the answer's shape, the calls) and a JSON summary: per set, answers taken as
calls, and for the call sets, the calls whose arguments validate against their tool's schema.
Models named as in ``benchmarks/real_models.py`` are fetched (and checked) first.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from real_models import resolve, write_report  # beside this script: the folder is on sys.path when it runs

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current local time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "description": "an IANA name, e.g. Europe/Paris"}},
            "required": ["timezone"],
        },
    },
}
TOOLS = [WEATHER, TIME]

QUESTIONS = {
    "one_call": [
        "Is it raining in Lisbon right now?",
        "What's the weather like in Tokyo?",
        "How warm is it in Cairo today, in fahrenheit?",
        "Should I take an umbrella in London this afternoon?",
        "What time is it in New York?",
        "Tell me the current time in Europe/Berlin.",
        "Is it snowing in Oslo?",
        "Weather in Buenos Aires, please.",
    ],
    "two_calls": [
        "What is the weather in Paris and in Rome?",
        "Compare the weather in Madrid and Barcelona right now.",
        "What time is it in Tokyo, and what's the weather there?",
        "Is it colder in Helsinki or in Reykjavik at the moment?",
    ],
    "no_tool": [
        "Write a Python function that reverses a string.",
        "What does the `yield` keyword do in Python?",
        "Write a haiku about the sea.",
        "Explain what a hash map is in two sentences.",
        "Fix the bug in this code: `def add(a, b): return a - b`",
        "What is the capital of Australia?",
    ],
    "json_answer": [
        "Give me a JSON object with the fields name and age for a person called Ada who is 36.",
        "Return a JSON array of three fruits, each an object with name and color.",
        "Write a package.json for a Node project called demo with express as a dependency.",
        "Convert this to JSON: city = Paris, temperature = 18, unit = celsius.",
        "Output a JSON object describing the weather in a fictional city, with fields city and forecast.",
        "Give me a JSON schema for an object with a required string field city.",
        "Respond only with JSON: an object with keys name and arguments, where name is 'demo' and arguments is {}.",
        "Show an example JSON body for a REST API call that creates a user with name and email.",
        'Format as JSON: {"name": "get_weather"} is what key and value?',
        "Print a JSON list of the first five prime numbers.",
    ],
}


def _valid(call, tools: list[dict]) -> bool:
    import jsonschema

    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.name)
    return jsonschema.Draft202012Validator(schema).is_valid(json.loads(call.arguments))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct-q4_k_m")
    ap.add_argument("--parser", default="hermes")
    ap.add_argument("--quantization", default=None, help="as `pagedllm serve --quantization` (default: the file's)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON summary here")
    args = ap.parse_args(argv)

    from pagedllm import LLM, SamplingParams
    from pagedllm.entrypoints.openai.tool_calls import TOOL_PARSERS

    path = resolve(args.model)
    llm = LLM(path, max_model_len=2048, **({"quantization": args.quantization} if args.quantization else {}))
    parser = TOOL_PARSERS[args.parser]().for_tools(TOOLS)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    summary: dict = {"model": Path(path).name, "parser": args.parser, "sets": {}}
    started = time.perf_counter()
    for name, questions in QUESTIONS.items():
        outs = llm.chat([[{"role": "user", "content": q}] for q in questions], params, use_tqdm=False, tools=TOOLS)
        taken = calls_total = valid = 0
        for q, out in zip(questions, outs):
            text = out.outputs[0].text
            _, calls = parser.extract(text)
            taken += bool(calls)
            calls_total += len(calls)
            valid += sum(_valid(c, TOOLS) for c in calls)
            shape = "calls" if calls else ("json" if text.lstrip().startswith(("{", "[", "```json")) else "text")
            print(f"{name:11} {shape:5} {q[:60]!r:64} {[(c.name, json.loads(c.arguments)) for c in calls]}")
            if not calls and name in ("one_call", "two_calls"):
                print(f"{'':11} answer: {text[:160]!r}")
        summary["sets"][name] = {
            "questions": len(questions),
            "answers_taken_as_calls": taken,
            "calls": calls_total,
            "calls_valid": valid,
        }
    summary["seconds"] = round(time.perf_counter() - started, 1)
    write_report(summary, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
