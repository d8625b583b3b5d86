"""The offline API: ``LLM(...).generate(prompts, SamplingParams(...))``, as in vLLM."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.processor import PromptType
from pagedllm.errors import InvalidParameterError
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pagedllm.beam_search import BeamSearchOutput, BeamSearchParams
    from pagedllm.lora import LoRARequest
    from pagedllm.pooling_params import PoolingParams

ChatMessage = dict[str, Any]


class LLM:
    """An engine for offline batch generation.

    Keyword arguments are the engine arguments (vLLM's names), e.g.
    ``LLM(model="path/or.gguf", max_model_len=4096, enable_prefix_caching=False)``;
    see :class:`pagedllm.config.EngineConfig` for all of them.
    """

    def __init__(self, model: str | None = None, **kwargs: Any):
        config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine(config)  # a pooling model (runner='pooling') runs in the same engine

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def _generator(self) -> LLMEngine:
        if self.llm_engine.is_pooling:
            raise InvalidParameterError(
                "this is a pooling model (runner='pooling'): use embed or score, not generation", "runner"
            )
        return self.llm_engine

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
        pooling_params: PoolingParams | None = None,
    ) -> list[Any]:
        """One ``EmbeddingRequestOutput`` per prompt (``.outputs.embedding``), in input order. The prompts are
        requests of the engine like generate's: batched in its steps under max_num_batched_tokens."""
        from pagedllm.pooling_params import PoolingParams

        if pooling_params is None:
            pooling_params = PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        elif truncate_prompt_tokens is not None:
            pooling_params = dataclasses.replace(pooling_params, truncate_prompt_tokens=truncate_prompt_tokens)
        return self.encode(prompts, pooling_params, use_tqdm)

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[Any]:
        """vLLM's ``LLM.encode``: the pooled output of each prompt (``EmbeddingRequestOutput``), in input order."""
        engine = self.llm_engine
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        ids = [str(next(engine._ids)) for _ in prompts]
        prepared = engine.make_pooling_requests(ids, prompts, pooling_params, group=ids[0] if ids else None)
        # queued shortest first: each step's sequences are then of like lengths, and an encoder's attention
        # (padded to the step's longest) wastes little; the outputs come back in input order
        for p in sorted(prepared, key=lambda p: p.children[0].num_prompt_tokens):
            engine.add_prepared_request(p)
        return self._run(ids, use_tqdm)

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[Any]:
        """The cosine similarity of each pair (one text against many, or pairwise), as vLLM scores with an
        embedding model; one ``ScoringRequestOutput`` (``.outputs.score``) per pair."""
        from pagedllm.engine.pooling import ScoringOutput, ScoringRequestOutput, pair_scores, score_texts

        outs = self.embed(score_texts(text_1, text_2), truncate_prompt_tokens, use_tqdm)
        ids = [o.prompt_token_ids for o in outs]
        scores = pair_scores([o.outputs.embedding for o in outs])
        n = len(scores)
        return [ScoringRequestOutput(str(i), ids[i] + ids[n + i], ScoringOutput(s)) for i, s in enumerate(scores)]

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | tuple[LoRARequest | None, ...] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. ``lora_request``: one adapter for
        every prompt, or one per prompt (None: the base model); needs ``enable_lora=True``."""
        self._generator()
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _broadcast(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise InvalidParameterError(f"priority has {len(priority)} entries for {len(prompts)} prompts", "priority")
        if lora_request is None or not isinstance(lora_request, (list, tuple)):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise InvalidParameterError(
                    f"lora_request has {len(loras)} entries for {len(prompts)} prompts", "lora_request"
                )
        # offline callers want the finished results only: skip building intermediate outputs
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                ids.append(engine.add_request(None, prompt, sp, priority[i] if priority else 0, loras[i]))
        except Exception:
            engine.abort_request(ids)  # leave the engine clean for the next call
            self._drain()
            raise
        return self._run(ids, use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search with transformers' algorithm (see :mod:`pagedllm.beam_search`); best sequences first.
        ``lora_request``: one adapter for every beam."""
        from pagedllm.beam_search import beam_search

        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        token_prompts = [self.llm_engine.processor.tokenize(p)[1] for p in prompts]
        for ids in token_prompts:
            self.llm_engine.processor.check(ids, SamplingParams(max_tokens=1))
        return beam_search(self.llm_engine, token_prompts, params, lora_request)

    def chat(
        self,
        messages: list[ChatMessage] | list[list[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate. ``tools``
        (OpenAI's function tools) reach the template, as in vLLM; the answers are not parsed for calls."""
        # one conversation (a list of messages) or several: told apart by the first element
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [cast("list[ChatMessage]", messages)] if single else cast("list[list[ChatMessage]]", messages)
        prompts: list[PromptType] = []
        for conv in conversations:
            conv, images = self._image_parts(conv)
            template = chat_template
            mm = self.llm_engine.mm_processor
            if images and template is None and mm is not None:  # the processor's template knows image parts
                template = mm.chat_template()
            prompt: dict[str, Any] = {
                "prompt_token_ids": self.apply_chat_template(
                    conv, template, add_generation_prompt, chat_template_kwargs, tools
                )
            }
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        outs = self.generate(prompts, sampling_params, use_tqdm)
        tok = self.get_tokenizer()
        for o in outs:
            o.prompt = tok.decode(o.prompt_token_ids, skip_special_tokens=False)
        return outs

    def _image_parts(self, conversation: list[ChatMessage]) -> tuple[list[ChatMessage], list[Any]]:
        """A conversation's ``image_url`` (a URL) and ``image_pil`` (a PIL image) parts as the template's
        ``{"type": "image"}`` placeholders, and the images in order (vision-language models; vLLM's parts)."""
        images: list[Any] = []
        out: list[ChatMessage] = []
        for m in conversation:
            content = m.get("content") if isinstance(m, dict) else None
            if not isinstance(content, list):
                out.append(m)
                continue
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("image_url", "image_pil"):
                    if self.llm_engine.mm_processor is None:
                        raise InvalidParameterError(
                            f"{self.llm_engine.source.name} is a text-only model: it takes no images", "messages"
                        )
                    value = part.get(kind)
                    images.append(value.get("url") if kind == "image_url" and isinstance(value, dict) else value)
                    parts.append({"type": "image"})
                else:
                    parts.append(part)
            out.append(cast("ChatMessage", {**m, "content": parts}))
        return out, images

    def apply_chat_template(
        self,
        conversation: list[ChatMessage],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        tok = self.get_tokenizer()
        mm = self.llm_engine.mm_processor
        if chat_template is None and getattr(tok, "chat_template", None) is None and mm is not None:
            chat_template = mm.chat_template()  # a vision-language checkpoint's processor may hold it
        if chat_template is None and getattr(tok, "chat_template", None) is None:
            raise InvalidParameterError(
                "this model's tokenizer has no chat template; pass chat_template=", "chat_template"
            )
        for m in conversation:
            if not isinstance(m, dict) or "role" not in m:
                raise InvalidParameterError(f"each chat message needs a 'role', got {m!r}", "messages")
        text = tok.apply_chat_template(
            conversation,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **(chat_template_kwargs or {}),
        )
        # the template already contains the special tokens; don't let encode add a BOS twice
        return tok.encode(text, add_special_tokens=False)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while len(done) < len(wanted):
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
            self._drain()  # pipeline parallelism: steps still in flight (they finish nothing of ours)
        except BaseException:
            engine.abort_request([i for i in ids if i not in done])
            self._drain()
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    def _drain(self) -> None:
        """Deliver pending aborts so every block they held returns to the pool."""
        while self.llm_engine.has_unfinished_requests():
            self.llm_engine.step()


def _broadcast(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise InvalidParameterError(f"got {len(params)} SamplingParams for {n} prompts", "sampling_params")
    return params
