"""``POST /v1/embeddings``: one pooling request per input, on a model served by the pooling
runner (``--runner pooling``, or a checkpoint with a sentence-transformers pipeline)."""

from __future__ import annotations

import asyncio
import base64
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from hookllm.engine.async_llm import EngineDeadError, EngineStepError
from hookllm.pooling_params import PoolingParams
from hookllm.server.errors import OpenAIError, engine_error, error_responses
from hookllm.server.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from hookllm.server.state import server_state
from hookllm.server.streaming import until_disconnect

router = APIRouter()


@router.post("/v1/embeddings", response_model=EmbeddingResponse,
             responses={200: {"description": "One embedding per input, in input order"},
                        **error_responses(400, 404, 500, 503)})
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response | EmbeddingResponse:
    state = server_state(request)
    name = state.model_name(body.model)
    inputs = body.input if isinstance(body.input, list) and not isinstance(body.input[0], int) else [body.input]
    try:
        params = PoolingParams(task="embed", dimensions=body.dimensions, normalize=body.normalize,
                               truncate_prompt_tokens=body.truncate_prompt_tokens)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None
    if not body.add_special_tokens:  # text inputs tokenized here, without the tokenizer's BOS
        inputs = [{"prompt": text, "prompt_token_ids": await state.engine.tokenize(text, add_special_tokens=False)}
                  if isinstance(text, str) else text for text in inputs]
    base_id = f"embd-{uuid.uuid4().hex}"

    async def run() -> EmbeddingResponse:
        try:
            outputs = await asyncio.gather(*(state.engine.encode(text, params, f"{base_id}-{index}")
                                             for index, text in enumerate(inputs)))
        except (ValueError, EngineStepError, EngineDeadError) as exc:
            raise engine_error(exc) from None
        data = [EmbeddingData(index=index, embedding=embedding_value(output.outputs.data, body.encoding_format))
                for index, output in enumerate(outputs)]
        prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
        return EmbeddingResponse(id=base_id, model=name, data=data,
                                 usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens))

    return await until_disconnect(request, run())


def embedding_value(data, encoding_format: str) -> list[float] | str:
    """The embedding as JSON numbers, or as OpenAI's base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(data.float().numpy().astype("<f4").tobytes()).decode("ascii")
    return data.tolist()
