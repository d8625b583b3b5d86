"""OpenAI request/response models (pydantic), with vLLM's extra sampling fields."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    StrictInt,
    Tag,
    field_validator,
    model_serializer,
)

from pagedllm.errors import InvalidParameterError
from pagedllm.sampling_params import SamplingParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# A request model's fields take their JSON types as they are: an unknown field, "5" for an integer, true or 1.0 for
# a token id, are 400s naming the field (an integer is still a number)
_REQUEST = ConfigDict(extra="forbid", strict=True)


def _also_a_string(name: str) -> Callable[[dict[str, Any]], None]:
    """A model's JSON schema hook: field ``name``, which a before-validator builds from a string too, is
    documented as taking one (the schema says what the server accepts)."""

    def extra(schema: dict[str, Any]) -> None:
        field = schema["properties"][name]
        schema["properties"][name] = {"anyOf": [{"type": "string"}, field], "title": field.get("title", name)}

    return extra


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


# the 200 of an endpoint that streams with "stream": true: JSON, or Server-Sent Events
STREAMED: dict[int | str, dict[str, Any]] = {
    200: {"description": "The answer; with stream: true, Server-Sent Events", "content": {"text/event-stream": {}}}
}


class HealthResponse(BaseModel):
    status: Literal["ready"] = "ready"


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    # unknown fields are rejected (400 naming them), never silently ignored
    model_config = _REQUEST

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, strict=True)  # a fan-out count: "1000" or 1000.0 must not slip past the limit checks
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: int = 0
    # structured outputs: vLLM's extra_body field ({"json" | "regex" | "choice" | "grammar" | "json_object": ...})
    # and OpenAI's response_format ({"type": "json_schema", "json_schema": {"schema": ...}} | {"type": "json_object"})
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # disaggregated prefill / decode (vLLM's field): what a prefill engine answered, for the decode engine
    kv_transfer_params: dict[str, Any] | None = None

    def _structured(self) -> dict[str, Any] | None:
        rf = self.response_format
        if rf is None or rf.get("type") == "text":
            return self.structured_outputs
        if self.structured_outputs is not None:
            raise InvalidParameterError("give response_format or structured_outputs, not both", "response_format")
        kind = rf.get("type")
        if kind == "json_object":
            return {"json_object": True}
        if kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise InvalidParameterError(
                    "response_format.json_schema.schema must be a JSON schema object", "response_format.json_schema"
                )
            return {"json": spec["schema"]}
        raise InvalidParameterError(
            f"response_format.type must be text, json_object or json_schema; got {kind!r}", "response_format.type"
        )

    def _sampling(self, max_tokens: int | None, logprobs: int | None, structured: Any = ...) -> SamplingParams:
        kt = self.kv_transfer_params
        if self.stream and isinstance(kt, dict) and kt.get("do_remote_decode"):
            raise InvalidParameterError(
                "kv_transfer_params.do_remote_decode: the answer that says where the blocks wait is not streamed",
                "kv_transfer_params.do_remote_decode",
            )
        defaults = SamplingParams()
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
            min_p=defaults.min_p if self.min_p is None else self.min_p,
            presence_penalty=defaults.presence_penalty if self.presence_penalty is None else self.presence_penalty,
            frequency_penalty=defaults.frequency_penalty if self.frequency_penalty is None else self.frequency_penalty,
            repetition_penalty=(
                defaults.repetition_penalty if self.repetition_penalty is None else self.repetition_penalty
            ),
            logit_bias=cast("dict[int, float] | None", self.logit_bias),  # SamplingParams parses JSON's str keys
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self._structured() if structured is ... else structured,
            extra_args=None if self.kv_transfer_params is None else {"kv_transfer_params": self.kv_transfer_params},
        )


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def to_sampling_params(self) -> SamplingParams:
        return self._sampling(self.max_tokens, self.logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    tools: list[ToolDefinition] | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}; with tools it defaults to auto
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def resolved_tool_choice(self) -> str | dict[str, Any]:
        """The checked tool_choice: 'none', 'auto', 'required' or {"type": "function", "function": {"name"}}."""
        from pagedllm.entrypoints.openai.tool_calls import MAX_TOOLS

        choice = self.tool_choice
        if self.tools and len(self.tools) > MAX_TOOLS:
            raise InvalidParameterError(f"at most {MAX_TOOLS} tools, got {len(self.tools)}", "tools")
        if choice is None:
            return "auto" if self.tools else "none"
        if isinstance(choice, str):
            if choice not in ("none", "auto", "required"):
                raise InvalidParameterError(
                    f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}", "tool_choice"
                )
            if choice != "none" and not self.tools:
                raise InvalidParameterError(f"tool_choice {choice!r} needs tools", "tool_choice")
            return choice
        function = choice.get("function")
        name = function.get("name") if choice.get("type") == "function" and isinstance(function, dict) else None
        if not isinstance(name, str):
            raise InvalidParameterError(
                'a named tool_choice is {"type": "function", "function": {"name": ...}}', "tool_choice"
            )
        if not any(t.function.name == name for t in self.tools or []):
            raise InvalidParameterError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return {"type": "function", "function": {"name": name}}

    def to_sampling_params(self) -> SamplingParams:
        from pagedllm.entrypoints.openai.tool_calls import forced_schema

        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        structured = self._structured()
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
        parallel = self.parallel_tool_calls is not False
        schema = forced_schema(tools, self.resolved_tool_choice(), parallel) if tools else None
        if schema is not None:
            if structured is not None:
                raise InvalidParameterError(
                    "tool_choice 'required' or a named function cannot be combined with "
                    "response_format or structured_outputs",
                    "tool_choice",
                )
            structured = {"json": schema}
        return self._sampling(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, structured)


class PromptTokenUsageInfo(BaseModel):
    cached_tokens: int | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None  # with --enable-prompt-tokens-details


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill engine's: where the prompt's KV blocks wait


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None  # a prefill engine's: where the prompt's KV blocks wait


class DeltaToolCall(BaseModel):
    """One piece of a streamed tool call. Its id, type and name come in the call's first delta only; later ones
    leave them out rather than send nulls (as vLLM and OpenAI do): the official client's stream helper would
    otherwise overwrite the call's type with the null."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str] | None = None  # name (first delta) and / or a piece of the arguments

    @model_serializer(mode="wrap")
    def _leave_out_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=256)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    model_config = _REQUEST
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # with messages, as a chat request renders them (vLLM's tokenize takes these too)
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[StrictInt]  # "0", true or 0.0 are not token ids


class DetokenizeRequest(BaseModel):
    model_config = _REQUEST
    model: str | None = None
    tokens: list[StrictInt]  # "0", true or 0.0 are not token ids


class DetokenizeResponse(BaseModel):
    prompt: str


# -- pooling models -------------------------------------------------------------------------


class EmbeddingRequest(BaseModel):
    """OpenAI's /v1/embeddings, plus vLLM's ``truncate_prompt_tokens``."""

    model_config = _REQUEST
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class ScoreRequest(BaseModel):
    """vLLM's /score: one ``text_1`` against each ``text_2``, or pairwise."""

    model_config = _REQUEST
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankRequest(BaseModel):
    """vLLM's /rerank (Jina / Cohere style): the documents ordered by relevance to the query."""

    model_config = _REQUEST
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=1)
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: PoolingUsage
    results: list[RerankResult]


# -- the Responses API (/v1/responses) --------------------------------------------------------


def _item_type(value: Any, default: str) -> str:
    return str(value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default))


class ResponsesTextPart(BaseModel):
    """A text part of a message item: ``input_text``, or ``output_text`` in an assistant message sent back."""

    model_config = _REQUEST
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # carried by an output_text part sent back; unused
    logprobs: list[Any] | None = None


def _text_parts(value: Any) -> Any:
    """A plain-string content as one text part (a list alone keeps the errors' locations free of union names)."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


class ResponsesMessageItem(BaseModel):
    """``{"role", "content"}`` (``type: "message"`` may be left out); an output message sent back carries its
    ``id`` and ``status`` too."""

    model_config = ConfigDict(**_REQUEST, json_schema_extra=_also_a_string("content"))
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[ResponsesTextPart]
    id: str | None = None
    status: str | None = None

    _parts = field_validator("content", mode="before")(_text_parts)


class ResponsesFunctionCallItem(BaseModel):
    """A call the model made (an output item sent back)."""

    model_config = _REQUEST
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class ResponsesFunctionCallOutputItem(BaseModel):
    """What the client's function returned for ``call_id``."""

    model_config = ConfigDict(**_REQUEST, json_schema_extra=_also_a_string("output"))
    type: Literal["function_call_output"]
    call_id: str
    output: list[ResponsesTextPart]
    id: str | None = None
    status: str | None = None

    _parts = field_validator("output", mode="before")(_text_parts)


ResponsesInputItem = Annotated[
    Annotated[ResponsesMessageItem, Tag("message")]
    | Annotated[ResponsesFunctionCallItem, Tag("function_call")]
    | Annotated[ResponsesFunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(lambda v: _item_type(v, "message")),
]


class ResponsesFunctionTool(BaseModel):
    """A function tool, in the Responses API's flat shape (chat nests the same fields under ``function``)."""

    model_config = _REQUEST
    type: Literal["function"] = "function"
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesBuiltinTool(BaseModel):
    """web_search, file_search, mcp, code_interpreter, ...: parsed only for the error to name it (no tool runs
    on this server)."""

    model_config = ConfigDict(extra="allow")
    type: str


ResponsesTool = Annotated[
    Annotated[ResponsesFunctionTool, Tag("function")] | Annotated[ResponsesBuiltinTool, Tag("builtin")],
    Discriminator(lambda v: "function" if _item_type(v, "") == "function" else "builtin"),
]


class ResponsesTextConfig(BaseModel):
    model_config = _REQUEST
    # {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "name", "schema", "strict", "description"}
    format: dict[str, Any] = Field(default_factory=lambda: {"type": "text"})


class ResponsesRequest(BaseModel):
    """OpenAI's ``POST /v1/responses``, plus vLLM's extra sampling fields. Options this server does not
    implement (background mode, built-in tools, ``truncation: "auto"``, ...) are refused by name."""

    model_config = ConfigDict(**_REQUEST, json_schema_extra=_also_a_string("input"))  # one user message
    model: str | None = None
    input: list[ResponsesInputItem]  # a string is one user message
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    tools: list[ResponsesTool] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: ResponsesTextConfig | None = None
    service_tier: Literal["auto", "default"] | None = None
    # refused unless off: checked by the route, so the error names them
    background: bool | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    prompt: dict[str, Any] | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    structured_outputs: dict[str, Any] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _one_message(cls, value: Any) -> Any:
        return [{"role": "user", "content": value}] if isinstance(value, str) else value


class ResponsesOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class ResponsesOutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[ResponsesOutputText]


class ResponsesFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ResponsesInputTokensDetails(BaseModel):
    cached_tokens: int = 0


class ResponsesOutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponsesUsage(BaseModel):
    input_tokens: int
    input_tokens_details: ResponsesInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponsesOutputTokensDetails = Field(default_factory=ResponsesOutputTokensDetails)
    total_tokens: int


class ResponsesIncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponsesResponse(BaseModel):
    """The response object: what POST answers (or streams last), GET returns and a later request continues."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: ResponsesIncompleteDetails | None = None
    error: None = None
    model: str
    output: list[ResponsesOutputMessage | ResponsesFunctionCall] = Field(default_factory=list)
    usage: ResponsesUsage | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[ResponsesFunctionTool] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    max_output_tokens: int | None = None
    text: ResponsesTextConfig = Field(default_factory=ResponsesTextConfig)
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    store: bool = True
    background: bool = False
    service_tier: str = "default"
