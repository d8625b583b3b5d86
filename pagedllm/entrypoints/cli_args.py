"""Argparse pieces shared by the `pagedllm` command and the subcommands other modules add (the benches).

Kept apart from :mod:`pagedllm.entrypoints.cli` so a bench can build its parser without importing
the CLI that imports every bench.
"""

from __future__ import annotations

import argparse
import json
import os
import types
import typing
from typing import Any

from pagedllm.config import EngineConfig


def _flag_type(section: str, name: str) -> tuple[Any, list | None]:
    """(argparse type, choices) for a config field such as ``int | None`` or ``Literal[...] | None``."""
    choices = EngineConfig.choices(section, name)
    if choices is not None:
        return str, [c for c in choices if c is not None]
    hint = EngineConfig.field_type(section, name)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint is dict:
        return _json_object, None
    return hint, None


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
    group = parser.add_argument_group("engine")
    for section, f in EngineConfig.all_fields():
        name = f.name.replace("_", "-")
        typ, choices = _flag_type(section, f.name)
        help_text = f.metadata.get("help", "")
        if f.name == "model" and positional_model:
            group.add_argument("model_pos", nargs="?", metavar="MODEL", help=help_text)
        if typ is bool:
            group.add_argument(
                f"--{name}", dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
            )
        else:
            group.add_argument(f"--{name}", dest=f.name, type=typ, choices=choices, default=f.default, help=help_text)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = {f.name: getattr(args, f.name) for _, f in EngineConfig.all_fields()}
    if getattr(args, "model_pos", None):
        kwargs["model"] = args.model_pos
    return kwargs


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default (unless the help text already states it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def add_log_level_flag(parser: argparse.ArgumentParser, top: bool) -> None:
    # on the top parser it sets the default; on a subcommand it may be repeated after the subcommand's name
    # None on the top parser: main() then takes PAGEDLLM_LOGGING_LEVEL, else INFO (the flag wins over the variable)
    parser.add_argument(
        "--log-level",
        default=None if top else argparse.SUPPRESS,
        type=str.upper,
        choices=LOG_LEVELS,
        help="level of pagedllm's log lines (start-up stages, warnings); "
        + ("" if top else "also accepted before the subcommand; ")
        + "default: $PAGEDLLM_LOGGING_LEVEL, else INFO",
    )


def resolve_log_level(flag: str | None) -> str:
    """The level a run logs at: ``--log-level`` if given, else ``PAGEDLLM_LOGGING_LEVEL``, else INFO."""
    if flag is not None:
        return flag
    env = os.environ.get("PAGEDLLM_LOGGING_LEVEL", "").strip().upper()
    if not env:
        return "INFO"
    if env not in LOG_LEVELS:
        raise SystemExit(f"PAGEDLLM_LOGGING_LEVEL={env!r} is not a level; use one of {', '.join(LOG_LEVELS)}")
    return env


def add_command(sub: argparse._SubParsersAction, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand parser with the shared flags and help formatting."""
    parser = sub.add_parser(name, formatter_class=HelpFormatter, **kwargs)
    add_log_level_flag(parser, top=False)
    return parser
