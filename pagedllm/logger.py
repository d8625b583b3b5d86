"""pagedllm's log output: INFO lines on stderr by default, as vLLM does.

Start-up stages that can take seconds (compiling kernels, converting a tokenizer,
loading weights) each say so as they begin, so a first run is never silent.
``PAGEDLLM_LOGGING_LEVEL`` sets the level (default INFO);
``PAGEDLLM_CONFIGURE_LOGGING=0`` leaves logging entirely to the application.
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER_NAME = "pagedllm"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (test runners swap it), never a stale stream."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def configure_logging() -> None:
    if os.environ.get("PAGEDLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    logger = logging.getLogger(LOGGER_NAME)
    if any(isinstance(h, _StderrHandler) for h in logger.handlers):
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("PAGEDLLM_LOGGING_LEVEL", "INFO").upper())
    logger.propagate = False  # the application's root handlers would print every line twice


def set_level(level: str) -> None:
    logging.getLogger(LOGGER_NAME).setLevel(level.upper())
