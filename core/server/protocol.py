"""The OpenAI-shaped request and response bodies (pydantic), and their mapping to SamplingParams.

Unknown request fields are ignored, as OpenAI-compatible servers commonly do; the sampling
fields OpenAI lacks (``top_k``, ``min_p``, ``ignore_eos``, ...) are accepted in the body, which is
where the openai client's ``extra_body`` puts them.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hookllm.sampling_params import SamplingParams, StructuredOutputsParams

# What the server accepts in ``stop`` (more is a 400 naming it). OpenAI takes 4 stop strings,
# vLLM any number; 64 of at most 1,000 characters bound what one request's stop-string automaton
# costs to build and hold (linear in their total length). The offline LLM API has no such limit:
# its caller pays for its own stop strings, and their number never slows the text's search.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1000


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: str | None = None
    description: str | None = None
    # "schema" would shadow pydantic's BaseModel.schema: the field is read under that alias.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(OpenAIModel):
    """Fields both endpoints map onto SamplingParams."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    # Not in OpenAI's API (the openai client sends them through extra_body).
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    extra_args: dict[str, Any] | None = None
    # OpenAI's JSON mode / structured outputs, and vLLM's body field; the structured plugin enforces them.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None

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

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError (a 400) for values SamplingParams refuses, and for ``n`` > 1."""
        if self.n != 1:
            # The engine runs n > 1 (LLM.generate); the server's choices and streams carry one.
            raise ValueError(f"n must be 1 here (the server returns one choice per prompt; the offline "
                             f"LLM API runs n > 1), got {self.n}")
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logprobs=logprobs, n=self.n,
            extra_args=self.extra_args or {}, structured_outputs=self.structured_outputs_params(),
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ImageURL(OpenAIModel):
    url: str
    detail: str | None = None


class ImagePart(OpenAIModel):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # hookllm.entrypoints.chat.render_chat's options, as vLLM accepts them.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None


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


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


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
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIModel):
    """vLLM's /tokenize body: a ``prompt``, or chat ``messages`` rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
