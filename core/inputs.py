"""The prompt shapes ``LLM.generate`` and ``LLMEngine.add_request`` take (vLLM's names)."""

from __future__ import annotations

from typing import Any, TypedDict, Union

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine; ``multi_modal_data`` goes to an active plugin."""

    prompt: str
    multi_modal_data: NotRequired[dict[str, Any]]


class TokensPrompt(TypedDict):
    """A prompt already tokenized: a list of int token ids. ``token_type_ids`` (pooling only): a
    text pair's segments as a BERT-style tokenizer marks them, 0 for the first text's tokens, 1
    for the second's."""

    prompt_token_ids: list[int]
    multi_modal_data: NotRequired[dict[str, Any]]
    token_type_ids: NotRequired[list[int]]


# A bare string is a text prompt; a bare list of ints is a tokens prompt.
PromptType = Union[str, list[int], TextPrompt, TokensPrompt]
