"""Chat conversations to prompts: the tokenizer's chat template, content parts through plugins.

A chat needs a chat template, the tokenizer's or one given (``LLM.chat(chat_template=...)``, a
request's ``chat_template``, ``--chat-template``); without either it is an error, as in vLLM.

Text parts join the message's text. Every other part (an image, a plugin's own type) goes to
the ``render_content_part`` hook, which says what text stands for it in the prompt (a model's
placeholder) and what ``multi_modal_data`` it adds: the core knows no model's placeholder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# How a model without a chat template can still chat, for the error that says it has none.
NO_CHAT_TEMPLATE = ("the model has no chat template: give one (LLM.chat(chat_template=...), the request's "
                    "chat_template field, or --chat-template FILE_OR_STRING for hookllm serve and generate), "
                    "or send a raw prompt (LLM.generate, /v1/completions)")


@dataclass
class RenderedContent:
    """What one non-text content part becomes: its text in the prompt and the inputs it adds."""

    text: str
    multi_modal_data: dict[str, list[Any]] = field(default_factory=dict)


def render_message_content(content: Any, hooks: Any, model_config: Any, data: dict[str, list[Any]]) -> str:
    """A message's content as text; non-text parts are rendered by plugins into ``data``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"a message's content is a string or a list of parts, got {type(content).__name__}")
    pieces = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            pieces.append(part.get("text", ""))
            continue
        rendered = hooks.hook.render_content_part(part=part, context=hooks.context)
        if rendered is None:
            raise ValueError(
                f"no active plugin renders chat content parts of type {kind!r} for "
                f"{model_config.architecture}; select one with --plugin (hookllm plugins lists them)"
            )
        pieces.append(rendered.text)
        for modality, items in rendered.multi_modal_data.items():
            data.setdefault(modality, []).extend(items)
    return "\n".join(pieces)


def render_chat(
    engine: Any,
    conversation: list[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One conversation -> a prompt dict (``prompt``, ``prompt_token_ids``, ``multi_modal_data``).

    ``chat_template`` overrides the tokenizer's template; ``continue_final_message`` leaves the
    last (assistant) message open instead of starting a new turn.
    """
    tokenizer = engine.tokenizer
    if tokenizer is None or not (chat_template or has_chat_template(tokenizer)):
        raise ValueError(NO_CHAT_TEMPLATE)
    if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
        raise ValueError("a conversation is a list of {'role': ..., 'content': ...} messages")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be set")
    data: dict[str, list[Any]] = {}
    messages = [
        {**m, "content": render_message_content(m.get("content"), engine.hooks, engine.model_config, data)}
        for m in conversation
    ]
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, chat_template=chat_template, tools=tools,
        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
        **(chat_template_kwargs or {}),
    )
    # The template already holds any BOS token: tokenize without adding special tokens again.
    prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False)["input_ids"]}
    if data:
        prompt["multi_modal_data"] = data
    return prompt


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``'s value as a template, as vLLM reads it: the text of the file it names,
    else the value itself when it reads as Jinja (``{{`` or ``{%``); ``ValueError`` otherwise
    (most likely a mistyped path)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template (no '{{{{' or '{{%')")
