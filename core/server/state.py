"""The server's state, one per app: the engine, the settings, the metrics and the LoRA adapters,
with the request handling the routes share (the model a request names, chat rendering, starting
requests), and the body's sampling parameters. Routes reach the state through ``server_state(request)``."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator
from urllib.parse import unquote, urlparse

from fastapi import Request
from pydantic import BaseModel

from hookllm.engine.async_llm import AsyncLLM, EngineDeadError, EngineStepError
from hookllm.lora.request import LoRARequest
from hookllm.outputs import RequestOutput
from hookllm.sampling_params import SamplingParams
from hookllm.server.errors import OpenAIError, engine_error
from hookllm.server.lora_registry import LoRAModulePath, LoRARegistry
from hookllm.server.metrics import ServerMetrics, request_arrival
from hookllm.server.protocol import (IGNORED_FIELDS, UNSUPPORTED_FIELDS, ChatCompletionRequest, SamplingFields,
                                     TokenizeRequest)
from hookllm.server.streaming import start_streams, tracked


@dataclass
class ServerSettings:
    served_model_names: list[str]
    model_root: str | None = None  # /v1/models' root: the model's hub id or folder name, never its path
    api_key: str | None = None
    allowed_local_media_path: Path | None = None
    # Chat replies' parsers, by the names plugins register them under (hookllm.server.reply_parsing).
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # The installed plugins' flags (their add_cli_options dests) with serve's values: each request's
    # extra_args start from them, and a body may set each as a top-level field.
    plugin_options: dict[str, Any] = field(default_factory=dict)
    # --chat-template's template: chats whose request gives none render with it, not the tokenizer's.
    chat_template: str | None = None
    log_requests: bool = False  # --enable-log-requests: each request's end, at debug level
    # --lora-modules' adapters, checked as the state is built; POST /v1/load_lora_adapter and
    # /v1/unload_lora_adapter exist only with allow_runtime_lora_updating (vLLM's environment variable).
    lora_modules: list[LoRAModulePath] = field(default_factory=list)
    allow_runtime_lora_updating: bool = False
    # This process's index among --api-server-count API server processes, and their count.
    api_server: tuple[int, int] = (0, 1)


@dataclass(frozen=True)
class ServedModel:
    """What a request's ``model`` names: the name its response reports, and its LoRA adapter
    (None: the base model)."""

    name: str
    lora_request: LoRARequest | None = None


@dataclass
class ServerState:
    engine: AsyncLLM
    settings: ServerSettings
    metrics: ServerMetrics
    loras: LoRARegistry

    @classmethod
    def create(cls, engine: AsyncLLM, settings: ServerSettings) -> ServerState:
        """The state of a server over ``engine``; ``ValueError`` naming a ``--lora-modules``
        adapter that does not fit the base model (the server does not start)."""
        names = settings.served_model_names
        # An adapter's base model may be named by the model's path, its hub id or a served name.
        base_names = [engine.config.model, *([settings.model_root] if settings.model_root else []), *names]
        loras = LoRARegistry(engine, names, base_names, settings.lora_modules, settings.api_server)
        return cls(engine, settings, ServerMetrics(engine, names[0]), loras)

    @property
    def max_model_len(self) -> int:
        return self.engine.model_config.max_model_len

    async def served_model(self, requested: str | None) -> ServedModel:
        """The model a request names: a served name of the base model (absent: the first), or a
        LoRA adapter's name, which the ``resolve_lora_adapter`` hook may find if no adapter has
        it yet. An adapter it finds that does not fit is a 400, a name nothing serves a 404."""
        names = self.settings.served_model_names
        if requested is None or requested in names:
            return ServedModel(names[0])
        adapter = self.loras.get(requested)
        if adapter is None and self.loras.enabled:
            try:
                adapter = await self.loras.resolve(requested)
            except ValueError as exc:
                raise OpenAIError(400, str(exc), param="model") from None
        if adapter is None:
            raise OpenAIError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")
        return ServedModel(adapter.lora_name, adapter)

    def sampling_params(self, body: SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The body's ``SamplingParams``; a value they refuse, or a field the server does not know,
        is a 400 naming the body's field."""
        extra_args = self.extra_args(body)
        try:
            return body.sampling_params(max_tokens, logprobs, extra_args)
        except ValueError as exc:
            param = str(exc).split(" ", 1)[0].rstrip(":")
            raise OpenAIError(400, str(exc), param=param if param in type(body).model_fields else None) from None

    def extra_args(self, body: BaseModel) -> dict[str, Any]:
        """The request's ``SamplingParams.extra_args``: the server's plugin flags, overridden by the
        plugin options the body sets as top-level fields, overridden by its ``extra_args`` field
        (or vLLM's name for it, ``vllm_xargs``).
        Any other field its model does not declare goes through ``check_ignored`` (a 400 unless
        harmless), so that none is silently dropped."""
        options = {}
        for name, value in (body.model_extra or {}).items():
            if name in self.settings.plugin_options:
                options[name] = value
            else:
                check_ignored(name, value)
        return {**self.settings.plugin_options, **options, **(getattr(body, "vllm_xargs", None) or {}),
                **(getattr(body, "extra_args", None) or {})}

    async def start(self, prompts: list[Any], params: SamplingParams, base_id: str,
                    lora_request: LoRARequest | None = None) -> list[AsyncIterator[RequestOutput]]:
        """One engine request per prompt (``{base_id}-{index}``, with ``lora_request``'s adapter
        if any), each past its first output.

        A prompt and ``max_tokens`` that together exceed ``max_model_len`` are a 400 here, as in
        vLLM's server (the offline API caps ``max_tokens`` instead). Text prompts are tokenized
        for that here and sent with their token ids, so the engine does not tokenize them again.
        """
        arrival = request_arrival()  # the HTTP request's: its tokenizing and queueing count in its latencies
        if params.max_tokens is not None:
            prompts = [await self._fitted(prompt, params.max_tokens, i) for i, prompt in enumerate(prompts)]
        gens = [tracked(self.engine, self.metrics, prompt, params, f"{base_id}-{i}", arrival,
                        self.settings.log_requests, lora_request) for i, prompt in enumerate(prompts)]
        try:
            return await start_streams(gens)
        except (ValueError, EngineStepError, EngineDeadError) as exc:
            raise engine_error(exc) from None

    async def _fitted(self, prompt: Any, max_tokens: int, index: int) -> Any:
        """``prompt`` with its token ids; OpenAIError 400 if they and ``max_tokens`` exceed the context."""
        if isinstance(prompt, str):
            prompt = {"prompt": prompt, "prompt_token_ids": await self.engine.tokenize(prompt)}
        num_tokens = len(prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt)
        if num_tokens + max_tokens > self.max_model_len:
            raise OpenAIError(400, f"this model's maximum context length is {self.max_model_len} tokens, but "
                              f"prompt {index} has {num_tokens} tokens and max_tokens is {max_tokens} "
                              f"({num_tokens + max_tokens} in all)", param="max_tokens")
        return prompt

    async def render_chat(self, body: ChatCompletionRequest | TokenizeRequest, **kwargs: Any) -> dict[str, Any]:
        """``body.messages`` through the chat template (``kwargs``: ``engine.render_chat``'s): the
        request's own, else the server's ``--chat-template``, else the tokenizer's."""
        template = kwargs.pop("chat_template", None) or self.settings.chat_template
        try:
            return await self.engine.render_chat(self._conversation(body), chat_template=template, **kwargs)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="messages") from None

    def _conversation(self, body: ChatCompletionRequest | TokenizeRequest) -> list[dict[str, Any]]:
        messages = [message.model_dump(exclude_none=True) for message in body.messages or []]
        for message in messages:
            for part in message.get("content") if isinstance(message.get("content"), list) else []:
                if part["type"] == "image_url":
                    part["image_url"]["url"] = self._local_media(part["image_url"]["url"])
            for call in message.get("tool_calls", []):
                # Chat templates write the arguments out as an object (tojson, items()): vLLM's
                # way too. Arguments that are no JSON reach the template as the text they are.
                with contextlib.suppress(ValueError):
                    call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        return messages

    def _local_media(self, url: str) -> str:
        """An ``image_url`` as the image plugin reads it: data URLs as they are, ``file://`` URLs
        as a path, only inside ``--allowed-local-media-path``; nothing else is fetched."""
        if url.startswith("data:"):
            return url
        parsed = urlparse(url)
        if parsed.scheme != "file":
            raise OpenAIError(400, "image_url must be a base64 data: URL (or a file:// URL under the server's "
                              "--allowed-local-media-path)", param="messages")
        root = self.settings.allowed_local_media_path
        if root is None:
            raise OpenAIError(400, "file:// image URLs are refused: the server has no --allowed-local-media-path",
                              param="messages")
        path = Path(unquote(parsed.path)).resolve()
        if not path.is_relative_to(root):
            raise OpenAIError(400, f"file:// image URLs must point inside {root}", param="messages")
        return str(path)


def check_ignored(name: str, value: Any) -> None:
    """A body field that neither the request model nor a plugin declares: accepted (and ignored)
    when null, one of ``IGNORED_FIELDS`` with a value it takes, or one of ``UNSUPPORTED_FIELDS``
    with the value that asks for nothing; otherwise a 400 naming it."""
    if value is None:
        return
    if name in UNSUPPORTED_FIELDS:
        accepted, reason = UNSUPPORTED_FIELDS[name]
        if value != accepted:
            raise OpenAIError(400, f"{name}: {json.dumps(value)} is not supported ({reason}; accepted only as "
                              f"{json.dumps(accepted)})", param=name)
        return
    if name not in IGNORED_FIELDS:
        raise OpenAIError(400, f"unknown field {name!r}: this server does not support it", param=name)
    accepted = IGNORED_FIELDS[name]
    if accepted is not None and value not in accepted:
        raise OpenAIError(400, f"{name}: {value!r} is not supported (accepted only as "
                          f"{' or '.join(map(repr, accepted))}, and ignored)", param=name)


def server_state(request: Request) -> ServerState:
    return request.app.state.server
