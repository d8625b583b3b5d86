"""Bounds on what one HTTP request may ask for, checked before any work proportional to them.

Every size a client chooses (completions per prompt, prompts per request, list
lengths) is compared with these limits as soon as the JSON body is parsed, before
the protocol models validate it, before tokenization and before the fan-out into
child requests, so a hostile request costs the server next to nothing and gets a
400 naming the field and the limit. Each field is
a ``pagedllm serve`` flag (``--max-n``, ``--max-prompts-per-request``, ...).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pagedllm.errors import InvalidParameterError

# what answers without the API key by default (`--open-endpoints`): the probes, and the dashboard's page (static:
# the snapshot stream it reads is keyed). Every other path, unknown ones included, needs the key.
OPEN_ENDPOINTS = ("/health", "/metrics", "/version", "/dashboard")


def _f(default: int, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(slots=True, frozen=True)
class RequestLimits:
    max_n: int = _f(128, "Most completions per prompt (`n`) a request may ask for.")
    max_prompts_per_request: int = _f(256, "Most prompts in one /v1/completions batch.")
    max_completions_per_request: int = _f(
        512, "Most completions one request may ask for in all (prompts x n); each is a sequence in the engine."
    )
    max_stop: int = _f(64, "Most `stop` strings per request.")
    max_stop_length: int = _f(1024, "Longest `stop` string, in characters.")
    max_stop_token_ids: int = _f(1024, "Most `stop_token_ids` per request.")
    max_logit_bias: int = _f(1024, "Most `logit_bias` entries per request.")
    max_allowed_token_ids: int = _f(65536, "Most `allowed_token_ids` per request.")
    max_bad_words: int = _f(256, "Most `bad_words` per request.")
    max_bad_word_length: int = _f(1024, "Longest `bad_words` entry, in characters.")
    max_messages: int = _f(2048, "Most chat messages (or Responses API input items) per request.")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParameterError(f"{f.name} must be an integer >= 1, got {value!r}", f.name)

    def check(self, body: Any) -> None:
        """Raise InvalidParameterError (a 400) for the first field of a raw JSON body over its limit.

        Runs on the parsed JSON before the protocol models validate it, so no
        over-long list is ever iterated; fields of the wrong type are left for
        that validation to reject.
        """
        if not isinstance(body, dict):
            return
        n = body.get("n", 1)
        n = n if isinstance(n, int) and not isinstance(n, bool) else 1
        _at_most("n", n, self.max_n, "max_n", "completions per prompt")
        prompts = _num_prompts(body.get("prompt"))
        _at_most("prompt", prompts, self.max_prompts_per_request, "max_prompts_per_request", "prompts")
        _at_most(
            "n",
            prompts * n,
            self.max_completions_per_request,
            "max_completions_per_request",
            f"completions (prompts x n = {prompts} x {n})",
        )
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
        _at_most("stop", len(stop), self.max_stop, "max_stop", "stop strings")
        _at_most("stop", _longest(stop), self.max_stop_length, "max_stop_length", "characters in a stop string")
        for name, limit in (
            ("stop_token_ids", "max_stop_token_ids"),
            ("logit_bias", "max_logit_bias"),
            ("allowed_token_ids", "max_allowed_token_ids"),
            ("bad_words", "max_bad_words"),
            ("messages", "max_messages"),
        ):
            value = body.get(name)
            if isinstance(value, (list, dict)):
                _at_most(name, len(value), getattr(self, limit), limit)
        items = body.get("input")
        if isinstance(items, list) and items and isinstance(items[0], dict):  # the Responses API's input items
            _at_most("input", len(items), self.max_messages, "max_messages", "input items")
        else:
            _at_most("input", _num_prompts(items), self.max_prompts_per_request, "max_prompts_per_request", "inputs")
        for name in ("documents", "text_1", "text_2"):  # the pooling endpoints' batches
            _at_most(
                name, _num_prompts(body.get(name)), self.max_prompts_per_request, "max_prompts_per_request", "inputs"
            )
        words = body.get("bad_words")
        if isinstance(words, list):
            _at_most(
                "bad_words",
                _longest(words),
                self.max_bad_word_length,
                "max_bad_word_length",
                "characters in a bad word",
            )


def _num_prompts(prompt: Any) -> int:
    """A string or one list of token ids is one prompt; a list of strings or of id lists is a batch."""
    if not isinstance(prompt, list) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def _longest(items: list) -> int:
    return max((len(x) for x in items if isinstance(x, str)), default=0)


def _at_most(param: str, value: int, limit: int, flag: str, what: str | None = None) -> None:
    if value > limit:
        raise InvalidParameterError(
            f"{param}: {value} {what or 'entries'} exceeds this server's limit of {limit} (--{flag.replace('_', '-')})",
            param,
        )
