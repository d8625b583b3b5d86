"""The command line: every flag is documented with its default, global flags work in either position,
and input that needs no model is refused before the model loads."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from pagedllm.entrypoints.cli import HelpFormatter, build_parser


def _parsers(parser: argparse.ArgumentParser, path: str = "pagedllm"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_every_flag_has_help_text_that_shows_its_default():
    parsers = dict(_parsers(build_parser()))
    assert {
        "pagedllm generate",
        "pagedllm serve",
        "pagedllm bench startup",
        "pagedllm bench throughput",
        "pagedllm bench latency",
        "pagedllm bench accuracy",
        "pagedllm bench serve",
    } <= set(parsers)
    for path, parser in parsers.items():
        formatter = HelpFormatter(path)
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            flag = f"{path} {action.option_strings[-1]}"
            assert action.help, f"{flag} has no help text"
            assert "default" in formatter._get_help_string(action).lower(), f"{flag} does not show its default"


@pytest.mark.parametrize(
    "argv",
    [
        ["--log-level", "debug", "generate", "hi"],
        ["generate", "hi", "--log-level", "DEBUG"],
        ["bench", "startup", "--log-level", "debug"],
    ],
)
def test_log_level_is_accepted_before_or_after_the_subcommand(argv):
    assert build_parser().parse_args(argv).log_level == "DEBUG"
    assert build_parser().parse_args(argv[-2:] if argv[0] == "--log-level" else argv[:-2]).log_level is None


@pytest.mark.parametrize(
    "flag, env, level",
    [(None, None, "INFO"), (None, "warning", "WARNING"), ("DEBUG", "WARNING", "DEBUG"), (None, "", "INFO")],
)
def test_the_log_level_variable_sets_the_level_unless_the_flag_is_given(monkeypatch, flag, env, level):
    from pagedllm.entrypoints.cli_args import resolve_log_level

    if env is None:
        monkeypatch.delenv("PAGEDLLM_LOGGING_LEVEL", raising=False)
    else:
        monkeypatch.setenv("PAGEDLLM_LOGGING_LEVEL", env)
    assert resolve_log_level(flag) == level


def test_a_bad_log_level_variable_is_refused_naming_it(monkeypatch):
    from pagedllm.entrypoints.cli_args import resolve_log_level

    monkeypatch.setenv("PAGEDLLM_LOGGING_LEVEL", "loud")
    with pytest.raises(SystemExit, match="PAGEDLLM_LOGGING_LEVEL='LOUD'"):
        resolve_log_level(None)


def test_the_log_level_variable_quiets_a_real_run():
    """getting-started's example: the variable alone silences the INFO lines of a whole `generate` run."""
    env = {**os.environ, "PAGEDLLM_LOGGING_LEVEL": "WARNING"}
    r = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", "Hello", "--max-tokens", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert "INFO" not in r.stderr, r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "", "--model", "/nonexistent"], "prompt 0 is empty"),
        (["generate", "hi", "--max-tokens", "0", "--model", "/nonexistent"], "max_tokens"),
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--model", "/nonexistent/model.gguf"], "/nonexistent/model.gguf"),
    ],
)
def test_bad_input_is_refused_before_any_model_loads(args, message):
    r = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", *args], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "loading" not in r.stderr  # the engine never started


def test_a_long_start_up_stage_says_so_every_few_seconds(monkeypatch):
    """A first start on a busy machine spent 33 s compiling kernels without a line: each stage now reports while
    it runs (HEARTBEAT_S, 5 s; shortened here)."""
    import logging
    import time

    from pagedllm.worker import loader

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("pagedllm")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    monkeypatch.setattr(loader, "HEARTBEAT_S", 0.1)
    try:
        stages: dict[str, float] = {}
        with loader.timed_stage(stages, "kernels"):
            time.sleep(0.55)
        quick = len(lines)
        with loader.timed_stage(stages, "config"):
            pass
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert quick >= 3 and all("still in the kernels stage" in line for line in lines), lines
    assert len(lines) == quick  # a quick stage says nothing more
    assert stages["kernels"] >= 0.55
