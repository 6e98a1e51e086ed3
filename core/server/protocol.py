"""The OpenAI-shaped request and response bodies (pydantic), and their mapping to SamplingParams.

The sampling fields OpenAI lacks (``top_k``, ``min_p``, ``ignore_eos``, ...) are accepted in the
body, which is where the openai client's ``extra_body`` puts them. A body field the request model
does not declare is kept (``model_extra``): ``ServerState.extra_args`` takes it as a plugin
option, accepts it if it is null, one of ``IGNORED_FIELDS`` or one of ``UNSUPPORTED_FIELDS`` with
the value that asks for nothing, and refuses anything else (400), so that no field is ever
silently dropped. Objects inside messages stay lenient (unknown keys ignored).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from hookllm.sampling_params import SamplingParams, StructuredOutputsParams

# What the server accepts in ``stop`` (more is a 400 naming it). OpenAI takes 4 stop strings,
# vLLM any number; 64 of at most 1,000 characters bound what one request's stop-string automaton
# costs to build and hold (linear in their total length). The offline LLM API has no such limit:
# its caller pays for its own stop strings, and their number never slows the text's search.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1000
# The most choices (``n``, and candidates ``best_of``) per prompt: each is an engine request of its
# own, and a bound keeps one body from filling the batch. (OpenAI takes n up to 128 too.)
MAX_N = 128
# OpenAI's body fields that change nothing in an answer, accepted and ignored: each with the values
# it is accepted with (None: any). ``store`` only as false: the server keeps no completions.
IGNORED_FIELDS: dict[str, tuple[Any, ...] | None] = {
    "user": None, "metadata": None, "service_tier": None, "prompt_cache_key": None, "safety_identifier": None,
    "store": (False,),
}
# vLLM's and SGLang's body fields for what this server does not do: each is accepted with the value
# that asks for nothing (its default there: routers send them with every request) and is a 400
# giving the reason otherwise.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, str]] = {
    "return_hidden_states": (False, "hidden states are not served yet"),
    "spaces_between_special_tokens": (True, "special tokens are decoded as the tokenizer joins them"),
    "use_beam_search": (False, "beam search is offline only (LLM.beam_search)"),
    "length_penalty": (1.0, "it scores beam search, which is offline only"),
    "priority": (0, "requests are scheduled first come, first served"),
    "return_tokens_as_token_ids": (False, "logprobs name tokens by their text"),
    "return_token_ids": (False, "replies carry no token ids (POST /tokenize gives them)"),
    "prompt_logprobs": (None, "use echo with logprobs on /v1/completions"),
    "logits_processors": ([], "logits processors are plugins, chosen when the server starts (--plugin)"),
    "mm_processor_kwargs": ({}, "the multimodal processor takes no per-request options"),
    "kv_transfer_params": ({}, "there is no KV transfer (disaggregated prefill)"),
    "cache_salt": (None, "the prefix cache is not partitioned per salt"),
    "guided_decoding_backend": (None, "structured output has one backend, the structured plugin"),
    "guided_whitespace_pattern": (None, "structured output's JSON whitespace is not configurable"),
    "structural_tag": (None, "structural tags are not supported"),
    "prompt_embeds": (None, "prompts are text or token ids"),
    "echo": (False, "a chat reply does not repeat the final message"),
}
# vLLM's older structured-output fields, as ``structured_outputs``' keys.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class OpenAIModel(BaseModel):
    """A lenient part of a request (a message, a content part): keys it does not name are ignored."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an option not honoured is a 400 naming it

    include_usage: bool = False  # a last chunk with the whole request's usage
    continuous_usage_stats: bool = False  # ``usage`` so far on every chunk (vLLM's)


class JsonSchemaFormat(OpenAIModel):
    name: str | None = None
    description: str | None = None
    # "schema" would shadow pydantic's BaseModel.schema: the field is read under that alias.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(BaseModel):
    """Fields both endpoints map onto SamplingParams; undeclared ones are kept in ``model_extra``."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    # JSON's object keys are strings: pydantic reads them as token ids.
    logit_bias: dict[int, Annotated[float, Field(ge=-100, le=100)]] | None = None
    # Not in OpenAI's API (the openai client sends them through extra_body).
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    no_stop_trim: bool = False  # SGLang's name for include_stop_str_in_output
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    extra_args: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None  # vLLM's name for extra_args
    request_id: str | None = Field(None, min_length=1)  # vLLM's: the response's id ends with it
    # OpenAI's JSON mode / structured outputs, and vLLM's body field; the structured plugin enforces them.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def stop_is_bounded(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
        longest = max(map(len, strings), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, got {longest}")
        return stop

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """``response_format`` or ``structured_outputs`` as SamplingParams' field (ValueError: a 400)."""
        wanted = self.response_format is not None and self.response_format.type != "text"
        if wanted and self.structured_outputs is not None:
            raise ValueError("response_format and structured_outputs cannot both be set")
        guided = {name: getattr(self, name) for name in GUIDED_FIELDS if getattr(self, name) is not None}
        if guided:
            first = next(iter(guided))
            if wanted or self.structured_outputs is not None or len(guided) > 1:
                raise ValueError(f"{first}: set one of {', '.join(GUIDED_FIELDS)}, response_format and "
                                 f"structured_outputs, not several")
            return StructuredOutputsParams(**{GUIDED_FIELDS[first]: guided[first]})
        if self.structured_outputs is not None:
            try:
                return StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:  # an unknown key
                raise ValueError(f"structured_outputs: {exc}") from None
        if not wanted:
            return None
        if self.response_format.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.response_format.json_schema is None or self.response_format.json_schema.json_schema is None:
            raise ValueError("response_format: type json_schema needs json_schema.schema")
        return StructuredOutputsParams(json=self.response_format.json_schema.json_schema)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        extra_args: dict[str, Any]) -> SamplingParams:
        """Raises ValueError (a 400) for values SamplingParams refuses."""
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output or self.no_stop_trim,
            skip_special_tokens=self.skip_special_tokens, truncate_prompt_tokens=self.truncate_prompt_tokens,
            logprobs=logprobs, n=self.n,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            extra_args=extra_args, structured_outputs=self.structured_outputs_params(),
        )


# A prompt as token ids: not empty. (A text prompt may be empty if the tokenizer adds a BOS token.)
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: the prompt is scored, nothing generated
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    add_special_tokens: bool = True  # text prompts' tokenizing (vLLM's): false leaves out the BOS token

    @property
    def scores_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the answer is the prompt (with its logprobs), as vLLM gives it."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        extra_args: dict[str, Any]) -> SamplingParams:
        """With ``best_of`` > ``n``: ``best_of`` completions per prompt, with the logprob that ranks
        them (their cumulative one); the endpoint returns the ``n`` best (vLLM v0's way)."""
        params = super().sampling_params(max_tokens, logprobs, extra_args)
        if self.best_of is None or self.best_of == self.n:
            return params
        if self.best_of < self.n:
            raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        if self.stream:  # as OpenAI: the best are known only once every candidate has finished
            raise ValueError(f"best_of ({self.best_of}) > n ({self.n}) cannot be streamed")
        return dataclasses.replace(params, n=self.best_of, logprobs=0 if logprobs is None else logprobs)


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ImageURL(OpenAIModel):
    url: str
    detail: str | None = None


class ImagePart(OpenAIModel):
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


def tool_call_id() -> str:
    """A new tool call's id, shaped as OpenAI's."""
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCall(OpenAIModel):
    """A tool call in an assistant message: in a reply, or in the conversation sent back."""

    id: str = Field(default_factory=tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a "tool" message: the call it answers


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")  # the chat template sees the definition as sent

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    """``tool_choice`` naming the function to call."""

    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class ChatCompletionRequest(SamplingFields):
    # The schema states what top_logprobs_needs_logprobs checks: a top_logprobs number needs logprobs true.
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
        "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}})

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("top_logprobs")
    @classmethod
    def top_logprobs_needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        # As OpenAI: asked without logprobs, it would be silently dropped.
        if top_logprobs is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top_logprobs
    # hookllm.entrypoints.chat.render_chat's options, as vLLM accepts them.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ChatTool] | None = None
    # None: "auto" with tools, else "none" (hookllm.server.tool_calling says what each means).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # false: at most one call per reply
    # vLLM's: the chat template's ``documents`` and ``reasoning_effort`` variables; the rendered
    # prompt tokenized with special tokens (a BOS) added in front of the template's own.
    documents: list[dict[str, Any]] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    add_special_tokens: bool = False
    # With --reasoning-parser (vLLM's include_reasoning, SGLang's other two; see ReasoningOptions).
    include_reasoning: bool = True
    separate_reasoning: bool = True
    stream_reasoning: bool = True


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser: the reply's reasoning section
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = None  # on a call's first delta
    arguments: str | None = None  # a piece of the arguments' JSON text


class DeltaToolCall(BaseModel):
    index: int  # the call's place in the reply
    id: str | None = None  # on a call's first delta, with type
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "hookllm"
    root: str | None = None  # a LoRA adapter's: its folder
    parent: str | None = None  # a LoRA adapter's: the base model's name
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(OpenAIModel):
    """vLLM's ``/v1/load_lora_adapter`` body: the name requests will give as ``model``, and the
    adapter's PEFT folder on the server's disk."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(OpenAIModel):
    """vLLM's ``/v1/unload_lora_adapter`` body (its ``lora_int_id`` is accepted and ignored: the
    name says which)."""

    lora_name: str = Field(min_length=1)


class TokenizeRequest(OpenAIModel):
    """vLLM's /tokenize body: a ``prompt``, or chat ``messages`` rendered with the chat template."""

    # The schema states what the route checks: exactly one of the two is given (and not null).
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class EmbeddingRequest(OpenAIModel):
    """``POST /v1/embeddings`` (OpenAI's, with vLLM's extras ``truncate_prompt_tokens``,
    ``normalize`` and ``add_special_tokens``)."""

    model: str | None = None
    input: str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    normalize: bool | None = None
    add_special_tokens: bool = True


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64 of little-endian float32 with encoding_format "base64"


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class PoolingResponse(BaseModel):
    """What every pooling route's answer starts with (vLLM's shape)."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class EmbeddingResponse(PoolingResponse):
    data: list[EmbeddingData]
    usage: PoolingUsage


class PoolingRequest(OpenAIModel):
    """vLLM's ``POST /pooling``: the pooling runner's raw output for a task, per input."""

    model: str | None = None
    input: str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    task: Literal["encode", "embed", "classify"] = "encode"
    encoding_format: Literal["float", "base64"] = "float"
    truncate_prompt_tokens: int | None = Field(None, ge=1)


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    # encode: one list per input token; embed and classify: one list; base64: the float32 bytes
    data: list[list[float]] | list[float] | str


class ClassificationRequest(OpenAIModel):
    """vLLM's ``POST /classify``."""

    model: str | None = None
    input: str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    activation: bool = True


class ClassificationData(BaseModel):
    index: int
    label: str  # the most probable label's name (config.id2label)
    probs: list[float]
    num_classes: int


class ClassificationResponse(PoolingResponse):
    data: list[ClassificationData]
    usage: PoolingUsage


class PoolingListResponse(PoolingResponse):
    data: list[PoolingData]
    usage: PoolingUsage


class ScoreRequest(OpenAIModel):
    """vLLM's ``POST /score``: ``text_1`` against each ``text_2`` (or two lists of one length)."""

    model: str | None = None
    text_1: str | Annotated[list[str], Field(min_length=1)]
    text_2: str | Annotated[list[str], Field(min_length=1)]
    truncate_prompt_tokens: int | None = Field(None, ge=1)


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(PoolingResponse):
    data: list[ScoreData]
    usage: PoolingUsage


class RerankRequest(OpenAIModel):
    """``POST /rerank`` and ``/v1/rerank``: the Jina and Cohere request shape."""

    model: str | None = None
    query: str
    documents: Annotated[list[str], Field(min_length=1)]
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int  # the document's index in the request
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]  # best first
