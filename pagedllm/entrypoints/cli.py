"""The `pagedllm` command line. Engine flags are generated from the config dataclasses.

pagedllm generate "Once upon a time" --max-tokens 64
pagedllm generate --model /path/to/model.gguf --chat "Hi!"
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.entrypoints.cli_args import (
    HelpFormatter,
    add_command,
    add_engine_args,
    add_log_level_flag,
    engine_kwargs,
    resolve_log_level,
)
from pagedllm.entrypoints.graceful_server import (
    MAX_CONNECTIONS,
    REQUEST_BODY_TIMEOUT_S,
    REQUEST_HEADER_TIMEOUT_S,
    SERVER_KEEP_ALIVE_S,
    connection_bounds,
    graceful_server_class,
)

__all__ = ["HelpFormatter", "add_command", "add_engine_args", "build_parser", "engine_kwargs", "main"]

_STARTED = time.monotonic()  # the CLI module is the first thing the `pagedllm` command imports


def _checked_config(args: argparse.Namespace) -> EngineConfig:
    """The engine config of the flags, with the model located: bad flags and missing models fail here,
    in milliseconds, before anything loads."""
    from pagedllm.model_loader import resolve_model

    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    resolve_model(config.model_config.model)
    return config


def _cmd_generate(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams
    from pagedllm.errors import InvalidParameterError

    prompts = args.prompts or [sys.stdin.read()]
    # everything that needs no model is checked before the model loads
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
        stop=args.stop,
    )
    empty = [i for i, p in enumerate(prompts) if not p]
    if empty:
        raise InvalidParameterError(f"prompt {empty[0]} is empty: a prompt must have at least one token", "prompt")
    _checked_config(args)
    llm = LLM(**engine_kwargs(args))
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": c.text,
                        "token_ids": c.token_ids,
                        "finish_reason": c.finish_reason,
                        "num_cached_tokens": out.num_cached_tokens,
                    }
                )
            )
        else:
            print(c.text if args.chat else f"{prompt}{c.text}")
            if len(prompts) > 1:
                print("-" * 40)
    return 0


def _checked_serve_config(args: argparse.Namespace) -> EngineConfig:
    """:func:`_checked_config`, and the server's own flags."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
    config = _checked_config(args)
    if (args.lora_modules or args.allow_runtime_lora_updating) and not config.lora_config.enable_lora:
        raise SystemExit("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    if args.engine_state_interval <= 0:
        raise SystemExit("--engine-state-interval must be > 0 seconds")
    if args.max_stored_responses < 1:
        raise SystemExit("--max-stored-responses must be >= 1")
    if args.max_stored_response_bytes < 1:
        raise SystemExit("--max-stored-response-bytes must be >= 1")
    return config


def server_app(
    args: argparse.Namespace,
    on_ready: Callable[[], None] | None = None,
    on_dead: Callable[[BaseException], None] | None = None,
) -> tuple[Any, str]:
    """The FastAPI app `pagedllm serve ARGS` serves, and the served model's name: every request handler, limit
    and engine setting of the flags (the Ray Serve deployment builds its replicas' apps here too). Bad flags
    fail here, before the model loads."""
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine.warmup import render_chat_template
    from pagedllm.entrypoints.openai.limits import RequestLimits
    from pagedllm.entrypoints.openai.server import build_app
    from pagedllm.model_loader import DEFAULT_MODEL_NAME

    limits = RequestLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RequestLimits)})
    config = _checked_serve_config(args)
    lora_modules = _lora_modules(args.lora_modules or [])
    name = config.model_config.served_model_name or config.model_config.model or DEFAULT_MODEL_NAME
    chat_template = args.chat_template
    if chat_template is not None and os.path.isfile(chat_template):
        with open(chat_template) as f:
            chat_template = f.read()

    def factory() -> LLMEngine:  # pooling models too (runner='pooling'): a runner mode of the same engine
        engine = LLMEngine(config)
        if chat_template is not None:
            engine.tokenizer.chat_template = chat_template
            render_chat_template(engine.tokenizer)  # compiled before `ready`, as the warm-up does the model's own
        return engine

    app = build_app(
        factory,
        name,
        api_key=args.api_key or os.environ.get("PAGEDLLM_API_KEY"),
        max_queue_len=args.max_queue_len,
        max_body_bytes=args.max_request_body_bytes,
        limits=limits,
        on_ready=on_ready,
        trust_request_chat_template=args.trust_request_chat_template,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        trace_file=args.trace_file,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        lora_modules=lora_modules,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        engine_state_interval=args.engine_state_interval,
        max_stored_responses=args.max_stored_responses,
        max_stored_response_bytes=args.max_stored_response_bytes,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        request_body_timeout=args.request_body_timeout,
        on_dead=on_dead,
        open_endpoints=tuple(args.open_endpoints),
    )
    return app, name


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    _check_keep_alive(args)
    config = _checked_serve_config(args)  # before the socket opens; a bad argument fails once, not in every replica
    if config.parallel_config.data_parallel_size > 1:
        from pagedllm.entrypoints.data_parallel import serve_data_parallel

        return serve_data_parallel(args, args.argv)
    server = None
    name = ""

    def ready() -> None:
        while server is None or not server.started:  # the socket is bound, so /health answers 200 now
            time.sleep(0.01)
        logging.getLogger("pagedllm").info(
            "ready: serving %s at http://%s:%d/v1 (started in %.1fs)",
            name,
            args.host,
            args.port,
            time.monotonic() - _STARTED,
        )

    dead: list[BaseException] = []

    def stop_dead(error: BaseException) -> None:  # the engine failed beyond repair: exit for a restart
        logging.getLogger("pagedllm").critical("the engine can serve no more (%r): the server exits", error)
        dead.append(error)
        if server is not None:
            server.should_exit = True

    app, name = server_app(args, ready, stop_dead)
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
        timeout_keep_alive=args.timeout_keep_alive,
        **connection_bounds(args).uvicorn_kwargs(),
    )
    server = graceful_server_class()(uv_config)
    server.run()
    return 1 if dead else 0


def _lora_modules(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora-modules takes name=path, got {item!r}")
        if name in out:
            raise SystemExit(f"--lora-modules names {name!r} twice")
        out[name] = path
    return out


def _check_keep_alive(args: argparse.Namespace) -> None:
    if args.timeout_keep_alive < 1:
        raise SystemExit(f"--timeout-keep-alive must be > 0 seconds, got {args.timeout_keep_alive}")
    for flag in ("request_header_timeout", "request_body_timeout", "max_connections"):
        value = getattr(args, flag, 1)
        if not value > 0:
            raise SystemExit(f"--{flag.replace('_', '-')} must be > 0, got {value}")


def _cmd_router(args: argparse.Namespace) -> int:
    _check_keep_alive(args)
    from pagedllm.entrypoints.router import RouterConfig, run_router

    prefill = getattr(args, "prefill", None) or []
    config = RouterConfig(
        getattr(args, "decode", None) or args.backend,
        routing=args.routing,
        health_check_interval=args.health_check_interval,
        block_chars=args.block_chars,
        prefix_blocks=args.prefix_blocks,
        balance_threshold=args.balance_threshold,
        prefill=[u.rstrip("/") for u in prefill],
    )
    run_router(
        config,
        args.host,
        args.port,
        api_key=args.api_key or os.environ.get("PAGEDLLM_API_KEY"),
        log_level=args.uvicorn_log_level,
        max_body_bytes=args.max_request_body_bytes,
        timeout_keep_alive=args.timeout_keep_alive,
        connections=connection_bounds(args),
    )
    return 0


def _router_args(rt: argparse.ArgumentParser) -> None:
    """The options `pagedllm router` and `pagedllm disagg-proxy` share."""
    rt.add_argument(
        "--routing",
        default="prefix-aware",
        choices=["prefix-aware", "least-load", "round-robin"],
        help="prefix-aware: prompts that begin alike go to the same backend (its prefix cache), "
        "unless it is far busier than the least loaded; least-load: fewest running + waiting "
        "requests, from each backend's /metrics; round-robin",
    )
    rt.add_argument("--host", default="127.0.0.1", help="address to listen on")
    rt.add_argument("--port", type=int, default=8000, help="port to listen on")
    rt.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (passed on to backends)")
    rt.add_argument(
        "--health-check-interval",
        type=float,
        default=1.0,
        help="seconds between polls of each backend's /health and /metrics",
    )
    rt.add_argument("--prefix-blocks", type=int, default=4, help="prefix-aware: blocks of the prompt hashed")
    rt.add_argument("--block-chars", type=int, default=64, help="prefix-aware: characters per block")
    rt.add_argument(
        "--balance-threshold",
        type=int,
        default=8,
        help="prefix-aware: a backend this many requests busier than the least loaded is passed over",
    )
    rt.add_argument(
        "--max-request-body-bytes", type=int, default=4 << 20, help="larger bodies get 413 before they are read whole"
    )
    rt.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=SERVER_KEEP_ALIVE_S,
        help="seconds an idle kept-alive HTTP connection stays open; a client's pool must drop idle "
        "connections sooner (a proxy or load balancer in front: set this above its idle timeout)",
    )
    rt.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level",
    )
    _connection_args(rt)


def _connection_args(p: argparse.ArgumentParser) -> None:
    """The bounds on connections that `pagedllm serve` and the routers (the data-parallel front too) share."""
    p.add_argument(
        "--request-header-timeout",
        type=float,
        default=REQUEST_HEADER_TIMEOUT_S,
        help="seconds a request's headers may take to arrive whole; a connection that sends less is closed",
    )
    p.add_argument(
        "--request-body-timeout",
        type=float,
        default=REQUEST_BODY_TIMEOUT_S,
        help="seconds each chunk of a request's body may take to arrive; a stalled body gets a 408",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        help="open connections (and requests in flight) before new ones get 503; logged when reached",
    )


def _open_endpoints() -> tuple[str, ...]:
    from pagedllm.entrypoints.openai.limits import OPEN_ENDPOINTS

    return OPEN_ENDPOINTS


def _add_limit_args(parser: argparse.ArgumentParser) -> None:
    from pagedllm.entrypoints.openai.limits import RequestLimits

    group = parser.add_argument_group("request limits (a request over one gets a 400 naming the field)")
    for f in dataclasses.fields(RequestLimits):
        group.add_argument(
            f"--{f.name.replace('_', '-')}", dest=f.name, type=int, default=f.default, help=f.metadata["help"]
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm", description="A small, fast LLM inference engine.", formatter_class=HelpFormatter
    )
    add_log_level_flag(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = add_command(sub, "generate", help="generate text offline for one or more prompts")
    gen.add_argument("prompts", nargs="*", help="prompts (read from stdin when none given)")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    gen.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: keep the top tokens whose probabilities sum to this, in (0, 1]",
    )
    gen.add_argument("--top-k", type=int, default=0, help="keep only the k most likely tokens; 0 keeps all")
    gen.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="drop tokens less likely than this fraction of the top token's probability",
    )
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of the requests' sampling")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    srv = add_command(sub, "serve", help="serve an OpenAI-compatible HTTP API")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on")
    srv.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every endpoint but the open ones (or set PAGEDLLM_API_KEY)",
    )
    srv.add_argument(
        "--open-endpoints",
        nargs="*",
        default=list(_open_endpoints()),
        metavar="PATH",
        help="paths that answer without the API key (each exact; e.g. add /docs /openapi.json)",
    )
    srv.add_argument(
        "--max-queue-len",
        type=int,
        default=1024,
        help="most queued sequences (each prompt x n of a request counts); beyond it the server "
        "answers 503 with Retry-After",
    )
    srv.add_argument(
        "--chat-template", default=None, help="chat template (a file or the template text); default: the model's own"
    )
    srv.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let chat requests carry their own `chat_template` (Jinja runs on the server); "
        "without it such a request gets a 400",
    )
    srv.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let chat requests use tool_choice "auto": the model answers freely and '
        "--tool-call-parser lifts its tool calls out of the text",
    )
    srv.add_argument(
        "--tool-call-parser",
        default=None,
        choices=["hermes", "llama3_json"],
        help="the model's own tool-call format, for --enable-auto-tool-choice",
    )
    srv.add_argument(
        "--trace-file",
        default=None,
        metavar="PATH",
        help="write the engine's steps and requests as a Chrome / Perfetto trace (JSON) to PATH",
    )
    srv.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export one OpenTelemetry span per request over OTLP/HTTP to URL (e.g. "
        "http://collector:4318/v1/traces); needs pip install 'pagedllm[otel]'",
    )
    srv.add_argument(
        "--engine-state-interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="how often /v1/engine/state/stream (the /dashboard page's feed) snapshots the engine "
        "while anyone watches; one snapshot per interval serves every watcher",
    )
    srv.add_argument(
        "--max-stored-responses",
        type=int,
        default=1000,
        metavar="N",
        help="the Responses API keeps this many responses in memory (for GET /v1/responses/{id} and "
        "previous_response_id), the least recently used evicted first",
    )
    srv.add_argument(
        "--max-stored-response-bytes",
        type=int,
        default=256 << 20,
        metavar="BYTES",
        help="and at most this many bytes of them (each counted as its JSON and its conversation's); "
        "pagedllm:responses_store_bytes reports the total",
    )
    srv.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="completions and chat report usage.prompt_tokens_details.cached_tokens: the prompt tokens the "
        "prefix cache (or a KV tier) supplied instead of computing them (as vLLM's flag)",
    )
    srv.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=4 << 20,
        help="larger bodies get 413 (parsing JSON holds Python's GIL for ~25 ms per MiB, "
        "so this also bounds what one body costs everyone else)",
    )
    srv.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM waits for in-flight requests before aborting them",
    )
    srv.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=SERVER_KEEP_ALIVE_S,
        help="seconds an idle kept-alive HTTP connection stays open; a client's pool must drop idle "
        "connections sooner (a proxy or load balancer in front: set this above its idle timeout)",
    )
    _connection_args(srv)
    srv.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="log level of uvicorn's access and server lines",
    )
    srv.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) to serve, each selected by its name in a request's "
        "`model` field; needs --enable-lora",
    )
    srv.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter",
    )
    srv.add_argument(
        "--data-parallel-routing",
        default="least-load",
        choices=["least-load", "prefix-aware", "round-robin"],
        help="how the API server picks a replica for each request (see `pagedllm router`)",
    )
    _add_limit_args(srv)
    add_engine_args(srv, positional_model=True)
    srv.set_defaults(func=_cmd_serve)

    rt = add_command(sub, "router", help="one OpenAI-compatible front door for many pagedllm servers")
    rt.add_argument(
        "--backend",
        action="append",
        required=True,
        metavar="URL",
        help="a backend server's base URL, e.g. http://h1:8000 (repeat for each)",
    )
    _router_args(rt)
    rt.set_defaults(func=_cmd_router)

    dp = add_command(
        sub,
        "disagg-proxy",
        help="disaggregated prefill / decode: each request is computed by a "
        "prefill server, then decoded by a decode server",
    )
    dp.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL",
        help="a prefill server (kv_role kv_producer), e.g. http://127.0.0.1:8100 (repeat for each)",
    )
    dp.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="a decode server (kv_role kv_consumer) sharing the prefill servers' KV tier (repeat for each)",
    )
    _router_args(dp)
    dp.set_defaults(func=_cmd_router)

    bench = add_command(sub, "bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    from pagedllm.benchmarks import embed as bench_embed
    from pagedllm.benchmarks import offline as bench_offline
    from pagedllm.benchmarks import serve as bench_serve
    from pagedllm.benchmarks import soak as bench_soak
    from pagedllm.benchmarks import startup as bench_startup

    bench_serve.add_parser(bench)
    bench_soak.add_parser(bench)
    bench_embed.add_parser(bench)
    bench_offline.add_parsers(bench)
    bench_startup.add_parser(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pagedllm.malloc_arena import share_main_arena

    share_main_arena()  # before any thread starts: `serve` runs its engine on a thread of its own
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `serve --data-parallel-size` passes it on
    args.log_level = resolve_log_level(args.log_level)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    from pagedllm.errors import PagedLLMError
    from pagedllm.logger import set_level

    set_level(args.log_level)
    try:
        return args.func(args)
    except PagedLLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
