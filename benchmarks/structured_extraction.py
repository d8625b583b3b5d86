"""Structured outputs on a real model: a JSON record extracted from a paragraph, with the schema's grammar and
without it, on the same prompts, greedy, one request at a time.

    python benchmarks/structured_extraction.py [--model qwen2.5-coder-1.5b-instruct-q4_k_m | FILE.gguf]
        [--mode gguf] [--backend auto] [--max-tokens 256] [--out FILE.json]

Per run: how many answers parse as JSON, how many are valid against the schema, how many fields equal the
paragraph's facts, how many were cut by ``max_tokens`` (finish_reason ``length``), and decode tok/s (each
request's own timestamps: tokens after the first over the time after the first). The grammar's cost per token
is the ratio of the two decode rates; its compile time shows in the first constrained request's TTFT.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from real_models import resolve, write_report  # beside this script: the folder is on sys.path when it runs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string"},
        "occupation": {"type": "string"},
        "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "email": {"type": ["string", "null"]},
    },
    "required": ["name", "age", "city", "occupation", "languages", "email"],
    "additionalProperties": False,
}

# (paragraph, the facts it states)
RECORDS: list[tuple[str, dict]] = [
    (
        "Maria Fernandes, 34, has lived in Lisbon for a decade, where she works as a data engineer. She writes "
        "Python and Scala every day and can be reached at maria.f@example.pt.",
        {
            "name": "Maria Fernandes",
            "age": 34,
            "city": "Lisbon",
            "languages": ["Python", "Scala"],
            "email": "maria.f@example.pt",
        },
    ),
    (
        "Born in 1999 and 26 years old now, Kenji Watanabe moved to Osaka to teach mathematics at a high school. "
        "He codes in Rust for fun. He has no public email address.",
        {"name": "Kenji Watanabe", "age": 26, "city": "Osaka", "languages": ["Rust"], "email": None},
    ),
    (
        "The new hire is Aisha Bello (aisha.bello@example.ng), a 41-year-old security consultant from Lagos "
        "who audits code written in C, Go and Java.",
        {
            "name": "Aisha Bello",
            "age": 41,
            "city": "Lagos",
            "languages": ["C", "Go", "Java"],
            "email": "aisha.bello@example.ng",
        },
    ),
    (
        "Lukas Schmidt is a 29 year old game developer in Berlin. C++ is his main language, with some Lua for "
        "scripting. Mail: lukas@example.de.",
        {
            "name": "Lukas Schmidt",
            "age": 29,
            "city": "Berlin",
            "languages": ["C++", "Lua"],
            "email": "lukas@example.de",
        },
    ),
    (
        "At 52, Priya Raman still runs the bioinformatics lab she founded in Chennai. Her group's pipelines are "
        "written in R and Python. Write to her at p.raman@example.in.",
        {
            "name": "Priya Raman",
            "age": 52,
            "city": "Chennai",
            "languages": ["R", "Python"],
            "email": "p.raman@example.in",
        },
    ),
    (
        "Tom O'Neill, a 23-year-old junior web developer, started at a Dublin agency last spring. He builds "
        "front ends in TypeScript. He prefers not to share an email.",
        {"name": "Tom O'Neill", "age": 23, "city": "Dublin", "languages": ["TypeScript"], "email": None},
    ),
    (
        "Sofía Martínez (sofia.m@example.mx) is a 38-year-old embedded systems engineer in Guadalajara; she "
        "programs microcontrollers in C and writes test tooling in Python.",
        {
            "name": "Sofía Martínez",
            "age": 38,
            "city": "Guadalajara",
            "languages": ["C", "Python"],
            "email": "sofia.m@example.mx",
        },
    ),
    (
        "Our speaker, Olu Adeyemi, 45, is a site reliability engineer based in Toronto. He automates "
        "infrastructure in Go and Bash; contact olu@example.ca.",
        {"name": "Olu Adeyemi", "age": 45, "city": "Toronto", "languages": ["Go", "Bash"], "email": "olu@example.ca"},
    ),
]

INSTRUCTION = (
    "Extract the person's record from the paragraph as one JSON object with exactly these keys: name (string), "
    "age (integer), city (string), occupation (string), languages (list of programming languages), email "
    "(string, or null if none is given). Answer with the JSON only.\n\nParagraph: "
)


def score(text: str, facts: dict) -> dict:
    """Whether ``text`` parses, is valid against SCHEMA, and how many of the stated facts it gets right."""
    import jsonschema

    try:
        value = json.loads(text.strip().removeprefix("```json").removesuffix("```").strip())
    except json.JSONDecodeError:
        return {"parses": False, "valid": False, "facts_right": 0}
    valid = jsonschema.Draft202012Validator(SCHEMA).is_valid(value)
    right = 0
    if isinstance(value, dict):
        for key, want in facts.items():
            got = value.get(key)
            if key == "languages" and isinstance(got, list):
                right += sorted(map(str.lower, map(str, got))) == sorted(map(str.lower, want))
            else:
                right += got == want
    return {"parses": True, "valid": valid, "facts_right": right}


def run(llm, constrained: bool, max_tokens: int) -> dict:
    from pagedllm import SamplingParams
    from pagedllm.sampling_params import StructuredOutputsParams

    rows, rates = [], []
    for paragraph, facts in RECORDS:
        so = StructuredOutputsParams(json=SCHEMA) if constrained else None
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so)
        out = llm.chat([{"role": "user", "content": INSTRUCTION + paragraph}], sp, use_tqdm=False)[0]
        c, m = out.outputs[0], out.metrics
        n = len(c.token_ids)
        if n > 1:
            rates.append((n - 1) / (m.last_token_time - m.first_token_time))
        row = {"tokens": n, "finish_reason": c.finish_reason, "ttft_s": m.first_token_time - m.arrival_time}
        rows.append({**row, **score(c.text, facts), "text": c.text})
        print(f"{'grammar' if constrained else 'free'}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    facts = sum(len(f) for _, f in RECORDS)
    return {
        "answers": len(rows),
        "parse": sum(r["parses"] for r in rows),
        "valid": sum(r["valid"] for r in rows),
        "facts_right": f"{sum(r['facts_right'] for r in rows)}/{facts}",
        "cut_by_max_tokens": sum(r["finish_reason"] == "length" for r in rows),
        "decode_tok_s": statistics.median(rates),
        "first_ttft_s": rows[0]["ttft_s"],
        "median_ttft_s": statistics.median(r["ttft_s"] for r in rows),
        "rows": rows,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct-q4_k_m")
    p.add_argument("--mode", default="gguf", help="pagedllm's quantization mode")
    p.add_argument("--backend", default="auto", help="structured_outputs_config's backend: auto, xgrammar or guidance")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--out", default=None, help="also write the JSON report here")
    args = p.parse_args()
    from pathlib import Path

    from pagedllm import LLM

    model = str(resolve(args.model))
    t0 = time.perf_counter()
    llm = LLM(
        model=model,
        quantization=args.mode,
        max_model_len=2048,
        max_num_seqs=4,
        structured_outputs_config={"backend": args.backend},
    )
    report = {"model": model, "mode": args.mode, "backend": args.backend, "ready_s": time.perf_counter() - t0}
    report["free"] = run(llm, False, args.max_tokens)
    report["grammar"] = run(llm, True, args.max_tokens)
    for name in ("free", "grammar"):
        r = report[name]
        print(
            f"{name}: {r['parse']}/{r['answers']} parse, {r['valid']}/{r['answers']} valid, facts {r['facts_right']}, "
            f"{r['cut_by_max_tokens']} cut, decode {r['decode_tok_s']:.2f} tok/s, first TTFT {r['first_ttft_s']:.2f} s"
        )
    print(f"grammar's decode rate: {report['grammar']['decode_tok_s'] / report['free']['decode_tok_s']:.3f}x free")
    write_report(report, Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
