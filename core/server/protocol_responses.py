"""The bodies of ``POST /v1/responses`` (OpenAI's Responses API): the request with its input
items and tools, the Response object with its output items, and the streamed events, in the
shapes of the openai package's ``openai.types.responses``.

Only what the server implements is modelled; ``ResponsesRequest`` keeps every other body field
as an extra, for ``serving_responses`` to accept (vLLM-style sampling fields, values that ask for
nothing) or refuse by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, model_validator

from hookllm.server.protocol import JsonSchemaFormat, OpenAIModel, UsageInfo

ItemStatus = Literal["in_progress", "completed", "incomplete"]


# The request: input items and their content parts.

class InputText(OpenAIModel):
    """Text given in a message: the user's (``input_text``) or an earlier answer's (``output_text``)."""

    type: Literal["input_text", "output_text"]
    text: str


class InputImage(OpenAIModel):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None  # OpenAI's file storage: refused, the server has none
    detail: str | None = None


ContentPart = Annotated[InputText | InputImage, Field(discriminator="type")]


def _text_part(content: Any) -> Any:
    # A string is one text part: a bad part's error then names its place, not a union's branch.
    return [{"type": "input_text", "text": content}] if isinstance(content, str) else content


Content = Annotated[list[ContentPart], BeforeValidator(_text_part)]


class InputMessage(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content


class InputFunctionCall(OpenAIModel):
    """An earlier answer's function call, given back with its output for the next turn."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class InputFunctionCallOutput(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str
    output: Content


class ReasoningText(OpenAIModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class InputReasoning(OpenAIModel):
    """An earlier answer's reasoning item, given back with its output: accepted, and left out of
    the prompt (serving_responses.chat_messages)."""

    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None


def _item_type(item: Any) -> str | None:
    # A message may leave out its type (OpenAI's "easy input message").
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)


InputItem = Annotated[
    Union[Annotated[InputMessage, Tag("message")], Annotated[InputFunctionCall, Tag("function_call")],
          Annotated[InputFunctionCallOutput, Tag("function_call_output")], Annotated[InputReasoning, Tag("reasoning")]],
    Discriminator(_item_type),
]


def _user_message(value: Any) -> Any:
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


Input = Annotated[list[InputItem], BeforeValidator(_user_message)]  # a string is one user message


# The request: tools, formats and the body.

class FunctionTool(OpenAIModel):
    """Responses' flat function tool; chat's nests the same fields under ``function``."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class HostedTool(BaseModel):
    """A built-in tool (``web_search``, ``file_search``, ...): parsed only to be refused by its type."""

    model_config = ConfigDict(extra="allow")
    type: str


def _tool_type(tool: Any) -> str:
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return "function" if kind == "function" else "hosted"


Tool = Annotated[Union[Annotated[FunctionTool, Tag("function")], Annotated[HostedTool, Tag("hosted")]],
                 Discriminator(_tool_type)]


class NamedFunction(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(JsonSchemaFormat):
    """``text.format``: Responses' flat form of chat's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]


class TextConfig(OpenAIModel):
    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))
    verbosity: str | None = None


class ResponsesRequest(BaseModel):
    # Every other field is kept, to be accepted or refused by name (serving_responses.check_supported).
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: Input
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[Tool] = Field(default_factory=list)
    # A dict is another kind of choice (allowed_tools, a built-in tool's): parsed only to be refused.
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=TextConfig)
    stream: bool = False
    store: bool = True  # accepted: nothing is stored either way
    metadata: dict[str, str] | None = None
    # Hints with nothing to do here: accepted and echoed.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @model_validator(mode="before")
    @classmethod
    def null_is_absent(cls, body: Any) -> Any:
        """A field set to null takes its default, as in OpenAI's API (``stream: null`` included)."""
        return {name: value for name, value in body.items() if value is not None} if isinstance(body, dict) else body

    def echoed(self) -> dict[str, Any]:
        """The request fields a Response reports, with the values they took effect with."""
        return dict(instructions=self.instructions, max_output_tokens=self.max_output_tokens,
                    temperature=1.0 if self.temperature is None else self.temperature,
                    top_p=1.0 if self.top_p is None else self.top_p, tools=self.tools, tool_choice=self.tool_choice,
                    parallel_tool_calls=self.parallel_tool_calls, store=self.store,
                    text=self.text.model_dump(by_alias=True, exclude_none=True),
                    metadata=self.metadata or {}, user=self.user, safety_identifier=self.safety_identifier,
                    prompt_cache_key=self.prompt_cache_key)


# The Response object and its output items.

class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class OutputReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    status: ItemStatus
    summary: list[Any] = Field(default_factory=list)
    content: list[OutputReasoningText]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: ItemStatus
    call_id: str
    name: str
    arguments: str


OutputItem = OutputMessage | OutputReasoning | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, usage: UsageInfo) -> "ResponseUsage":
        return cls(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                   total_tokens=usage.total_tokens)


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: Literal["server_error"] = "server_error"
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    # The request's fields, echoed (ResponsesRequest.echoed).
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float
    top_p: float
    tools: list[Tool]
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    store: bool
    metadata: dict[str, str]
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    previous_response_id: None = None
    reasoning: None = None
    background: bool = False
    truncation: Literal["disabled"] = "disabled"


# The streamed events; ``sequence_number`` counts them from 0 (set as each is sent).

class StreamEvent(BaseModel):
    sequence_number: int = 0


class ResponseLifecycleEvent(StreamEvent):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                  "response.failed"]
    response: ResponseObject


class OutputItemEvent(StreamEvent):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ItemEvent(StreamEvent):
    """An event about one output item."""

    item_id: str
    output_index: int


class ContentEvent(ItemEvent):
    """An event about one content part of an output item."""

    content_index: int = 0


class ContentPartEvent(ContentEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    part: OutputText | OutputReasoningText


class OutputTextDelta(ContentEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class OutputTextDone(ContentEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningTextDelta(ContentEvent):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    delta: str


class ReasoningTextDone(ContentEvent):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    text: str


class FunctionCallArgumentsDelta(ItemEvent):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    delta: str


class FunctionCallArgumentsDone(ItemEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    name: str
    arguments: str
