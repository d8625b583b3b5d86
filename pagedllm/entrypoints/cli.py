"""The `pagedllm` command line. Engine flags are generated from the config dataclasses.

    pagedllm generate "Once upon a time" --max-tokens 64
    pagedllm generate --model /path/to/model.gguf --chat "Hi!"
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import types
import typing
from typing import Any

from pagedllm.config import EngineConfig


def _flag_type(annotation: Any) -> tuple[Any, list | None]:
    """(argparse type, choices) for a config field annotation such as ``int | None`` or ``Literal[...]``."""
    hint = annotation
    if isinstance(hint, str):
        hint = eval(hint, {**vars(typing), "Literal": typing.Literal})  # our own config annotations only
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in args if a is not type(None))
        args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        return str, list(args)
    return hint, None


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
    group = parser.add_argument_group("engine")
    for _, f in EngineConfig.all_fields():
        name = f.name.replace("_", "-")
        typ, choices = _flag_type(f.type)
        help_text = f.metadata.get("help", "")
        if f.name == "model" and positional_model:
            group.add_argument("model_pos", nargs="?", metavar="MODEL", help=help_text)
        if typ is bool:
            group.add_argument(f"--{name}", dest=f.name, action=argparse.BooleanOptionalAction,
                               default=f.default, help=help_text)
        else:
            group.add_argument(f"--{name}", dest=f.name, type=typ, choices=choices, default=f.default,
                               help=f"{help_text} (default: {f.default})")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = {f.name: getattr(args, f.name) for _, f in EngineConfig.all_fields()}
    if getattr(args, "model_pos", None):
        kwargs["model"] = args.model_pos
    return kwargs


def _cmd_generate(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    prompts = args.prompts or [sys.stdin.read()]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed, ignore_eos=args.ignore_eos,
                            stop=args.stop)
    llm = LLM(**engine_kwargs(args))
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason, "num_cached_tokens": out.num_cached_tokens}))
        else:
            print(c.text if args.chat else f"{prompt}{c.text}")
            if len(prompts) > 1:
                print("-" * 40)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="A small, fast LLM inference engine.")
    parser.add_argument("--log-level", default="WARNING", help="Python logging level (default: WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline for one or more prompts")
    gen.add_argument("prompts", nargs="*", help="prompts (read from stdin when none given)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of the requests' sampling")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from pagedllm.errors import PagedLLMError

    try:
        return args.func(args)
    except PagedLLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
