"""The small routes: ``/health``, ``/version``, ``/metrics``, ``/v1/models``, ``/tokenize`` and ``/detokenize``."""

from __future__ import annotations

from importlib import metadata

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from hookllm.server.errors import OpenAIError, error_responses
from hookllm.server.protocol import (DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList, TokenizeRequest,
                                     TokenizeResponse)
from hookllm.server.state import server_state

router = APIRouter()


@router.get("/health", response_class=Response,
            responses={200: {"description": "The engine runs"}, 503: {"description": "The engine has stopped"}})
async def health(request: Request) -> Response:
    return Response(status_code=200 if server_state(request).engine.is_running else 503)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": metadata.version("hookllm")}


@router.get("/metrics", response_class=PlainTextResponse)
async def show_metrics(request: Request) -> Response:
    return Response(server_state(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def show_available_models(request: Request) -> ModelList:
    """The base model under each served name, then each LoRA adapter (its ``root`` its folder,
    its ``parent`` the base model's first name), as vLLM lists them."""
    state = server_state(request)
    cards = [ModelCard(id=name, root=state.settings.model_root, max_model_len=state.max_model_len)
             for name in state.settings.served_model_names]
    cards += [ModelCard(id=adapter.lora_name, root=adapter.lora_path, parent=state.loras.parent,
                        max_model_len=state.max_model_len) for adapter in state.loras.adapters()]
    return ModelList(data=cards)


@router.post("/tokenize", responses=error_responses(400, 404))
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    state = server_state(request)
    await state.served_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise OpenAIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
    if body.messages is not None:
        tokens = (await state.render_chat(body, add_generation_prompt=body.add_generation_prompt))["prompt_token_ids"]
    else:
        tokens = await state.engine.tokenize(body.prompt, body.add_special_tokens)
    return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=state.max_model_len)


@router.post("/detokenize", responses=error_responses(400, 404))
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    state = server_state(request)
    await state.served_model(body.model)
    try:
        return DetokenizeResponse(prompt=await state.engine.detokenize(body.tokens))
    except Exception as exc:  # noqa: BLE001 - the tokenizer's error for ids it does not know
        raise OpenAIError(400, f"cannot detokenize: {exc}", param="tokens") from None
