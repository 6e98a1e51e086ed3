"""vLLM's routes that change the served LoRA adapters at run time: ``POST /v1/load_lora_adapter``
and ``POST /v1/unload_lora_adapter``. The app has them only when the environment allows it
(``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, ``hookllm.server.lora_registry.runtime_updating_allowed``),
as vLLM's has; otherwise they are unknown paths (404)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from hookllm.server.errors import OpenAIError, error_responses
from hookllm.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from hookllm.server.state import server_state

router = APIRouter()


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=error_responses(400))
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """Serve the adapter at ``lora_path`` as ``lora_name``: a 400 naming it if the name is taken,
    the server has no ``--enable-lora``, or the adapter does not fit the base model."""
    try:
        await server_state(request).loras.load(body.lora_name, body.lora_path)
    except ValueError as exc:
        raise OpenAIError(400, str(exc)) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=error_responses(400, 404))
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """Stop serving the adapter ``lora_name`` (requests running with it finish with it): a 404
    if no adapter has the name."""
    try:
        removed = server_state(request).loras.remove(body.lora_name)
    except ValueError as exc:
        raise OpenAIError(400, str(exc)) from None
    if removed is None:
        raise OpenAIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
