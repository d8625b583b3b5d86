"""Processor: prompt → token ids, with every limit checked before the engine sees the request."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pagedllm.errors import InvalidParameterError, PromptTooLongError
from pagedllm.sampling_params import SamplingParams, check_text

# A prompt as vLLM accepts it: text, or a dict with "prompt" text or "prompt_token_ids".
PromptType = str | dict[str, Any]


class Processor:
    def __init__(
        self, tokenizer: Any, vocab_size: int, max_model_len: int, max_logprobs: int, eos_token_ids: frozenset[int]
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.eos_token_ids = eos_token_ids

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        text: str | None  # a dict's values are the user's: checked below
        ids: Iterable[int] | None
        if isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:
                raise InvalidParameterError(f"unsupported prompt fields: {sorted(unknown)}", "prompt")
            text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            if text is None and ids is None:
                raise InvalidParameterError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
        else:
            raise InvalidParameterError(f"a prompt must be a string or a dict, got {type(prompt).__name__}", "prompt")
        if ids is None:
            if not isinstance(text, str):
                raise InvalidParameterError(f"prompt text must be a string, got {type(text).__name__}", "prompt")
            check_text("prompt", text)
            ids = self.tokenizer.encode(text) if text else []
        ids = list(ids)
        if not ids:
            raise InvalidParameterError("the prompt is empty: it must have at least one token", "prompt")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise InvalidParameterError(
                    f"prompt token id {t!r} is out of range [0, {self.vocab_size})", "prompt_token_ids"
                )
        return text, ids

    def tokenize_many(self, prompts: list[PromptType]) -> list[tuple[str | None, list[int]]]:
        """``tokenize`` for a batch (pooling: hundreds of sentences), the texts through the tokenizer in one call.
        An empty text is tokenized too (an encoder's [CLS] [SEP] is a prompt)."""
        texts = [p for p in prompts if isinstance(p, str)]
        if texts and getattr(self.tokenizer, "is_fast", False):
            encoded = iter(self.tokenizer(texts)["input_ids"])
        else:
            encoded = iter(self.tokenizer.encode(t) for t in texts)
        return [(p, list(next(encoded))) if isinstance(p, str) else self.tokenize(p) for p in prompts]

    def check_pooling(self, prompt_ids: list[int], truncate: int | None) -> list[int]:
        """A pooling prompt cut to ``truncate`` tokens (-1: max_model_len), keeping its final (special) token,
        as the tokenizer's own truncation does; refused when empty or longer than max_model_len."""
        if truncate == -1:
            truncate = self.max_model_len
        ids = prompt_ids
        if truncate is not None and len(ids) > truncate:
            ids = ids[: truncate - 1] + ids[-1:] if truncate > 1 else ids[:truncate]  # keep the final [SEP]
        if not ids:
            raise InvalidParameterError("the prompt is empty: it must have at least one token", "prompt")
        if len(ids) > self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens, more than this model's {self.max_model_len}"
                " (max_model_len); pass truncate_prompt_tokens to cut it",
                "prompt",
            )
        return ids

    def truncate(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        k = params.truncate_prompt_tokens
        return prompt_ids[-k:] if k is not None else prompt_ids

    def check(self, prompt_ids: list[int], params: SamplingParams, max_tokens_must_fit: bool = False) -> int:
        """Validate against the model's limits; bind EOS; return the effective max_tokens.

        A max_tokens beyond the context's room is cut to the room (offline, as vLLM's LLM does),
        or refused with ``max_tokens_must_fit`` (the OpenAI server, as OpenAI's API and vLLM's do).
        """
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {n} tokens, but the model's context length (max_model_len) is "
                f"{self.max_model_len}: it must be shorter to leave room for at least one output token",
                "prompt",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise InvalidParameterError(
                    f"{name}={value} exceeds the maximum allowed ({self.max_logprobs}); raise it with max_logprobs",
                    name,
                )
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids or []),
            ("allowed_token_ids", params.allowed_token_ids or []),
            ("logit_bias", list(params.logit_bias or {})),
        ):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise InvalidParameterError(
                    f"{name} contains token id {bad[0]}, outside the vocabulary [0, {self.vocab_size})", name
                )
        params.bind_eos(self.eos_token_ids)
        if params.bad_words:
            params._bad_words_token_ids = self._bad_words_ids(params.bad_words)
        if params.allowed_token_ids is not None:
            self._check_some_token_allowed(params)
        room = self.max_model_len - n
        if max_tokens_must_fit and params.max_tokens is not None and params.max_tokens > room:
            raise InvalidParameterError(
                f"max_tokens={params.max_tokens} is too large: the model's context length (max_model_len) is "
                f"{self.max_model_len} tokens and the prompt has {n}, which leaves room for {room} output tokens. "
                "Ask for fewer tokens or send a shorter prompt",
                "max_tokens",
            )
        return room if params.max_tokens is None else min(params.max_tokens, room)

    @staticmethod
    def _check_some_token_allowed(params: SamplingParams) -> None:
        """Refuse masks that together leave no token for the first step: the request could never produce one.
        (A grammar can still leave none at a later step; the sampler fails that request alone.)"""
        legal = set(params.allowed_token_ids or ()) - {ids[0] for ids in params._bad_words_token_ids if len(ids) == 1}
        if not legal:
            raise InvalidParameterError("bad_words bans every token in allowed_token_ids", "allowed_token_ids")
        if params.min_tokens > 0 and legal <= params._all_stop_token_ids:
            raise InvalidParameterError(
                f"allowed_token_ids holds only end-of-sequence or stop tokens, which min_tokens={params.min_tokens} "
                "forbids: no token could be generated",
                "allowed_token_ids",
            )

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, alone and after a space (as it tokenizes mid-sentence), like vLLM."""
        out: list[list[int]] = []
        for word in words:
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out
