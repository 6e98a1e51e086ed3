"""The pooling routes, on a model served by the pooling runner (``--runner pooling``, a
checkpoint with a sentence-transformers pipeline, or a ``*ForSequenceClassification`` one):
``POST /v1/embeddings`` (OpenAI's), ``/pooling``, ``/classify`` and ``/score`` (vLLM's), ``/rerank`` and
``/v1/rerank`` (the Jina and Cohere shape). Each input is one pooling request."""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from hookllm.engine.async_llm import EngineDeadError, EngineStepError
from hookllm.entrypoints.scoring import pair_scores, pair_texts, score_inputs, score_method
from hookllm.outputs import PoolingRequestOutput
from hookllm.pooling_params import PoolingParams
from hookllm.server.errors import OpenAIError, engine_error, error_responses
from hookllm.server.protocol import (ClassificationData, ClassificationRequest, ClassificationResponse, EmbeddingData,
                                     EmbeddingRequest, EmbeddingResponse, PoolingData, PoolingListResponse,
                                     PoolingRequest, PoolingUsage, RerankDocument, RerankRequest, RerankResponse,
                                     RerankResult, RerankUsage, ScoreData, ScoreRequest, ScoreResponse)
from hookllm.server.state import ServedModel, ServerState, server_state
from hookllm.server.streaming import until_disconnect

router = APIRouter()
RESPONSES = error_responses(400, 404, 500, 503)


def inputs_of(value: Any) -> list[Any]:
    """A request's ``input``: one string or token-id list, or a list of them."""
    return value if isinstance(value, list) and not isinstance(value[0], int) else [value]


def pooling_params(**fields: Any) -> PoolingParams:
    """The request's ``PoolingParams``; a value they refuse is a 400 naming its field."""
    try:
        return PoolingParams(**fields)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None


async def pool(state: ServerState, model: ServedModel, prompts: list[Any], params: PoolingParams,
               kind: str) -> list[PoolingRequestOutput]:
    """Run one pooling request per prompt, on ``model`` (its LoRA adapter, if any); the engine's
    errors as HTTP errors."""
    base_id = f"{kind}-{uuid.uuid4().hex}"
    try:
        return await asyncio.gather(*(state.engine.encode(prompt, params, f"{base_id}-{index}", model.lora_request)
                                      for index, prompt in enumerate(prompts)))
    except (ValueError, EngineStepError, EngineDeadError) as exc:
        raise engine_error(exc) from None


def usage(outputs: list[PoolingRequestOutput]) -> PoolingUsage:
    tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)


async def scores(state: ServerState, model: ServedModel, text_1: str | list[str], text_2: str | list[str],
                 truncate_prompt_tokens: int | None) -> tuple[list[float], int]:
    """Each pair's score (see ``LLM.score``) and the tokens read."""
    try:
        firsts, seconds = pair_texts(text_1, text_2)
        method = score_method(state.engine.model_config.pooler, state.engine.config.model)
    except ValueError as exc:
        raise OpenAIError(400, str(exc)) from None
    prompts, fields = score_inputs(method, state.engine.tokenizer, firsts, seconds)
    outputs = await pool(state, model, prompts,
                         pooling_params(**fields, truncate_prompt_tokens=truncate_prompt_tokens), "score")
    return pair_scores(outputs, method), usage(outputs).total_tokens


async def respond(request: Request, model: str | None,
                  answer: Callable[[ServerState, ServedModel], Awaitable[BaseModel]]) -> Response | BaseModel:
    """``answer(state, the model the request names)``, cancelled (its requests aborted) if the
    client disconnects first."""
    state = server_state(request)
    return await until_disconnect(request, answer(state, await state.served_model(model)))


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=RESPONSES)
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response | BaseModel:
    async def answer(state: ServerState, model: ServedModel) -> EmbeddingResponse:
        params = pooling_params(task="embed", dimensions=body.dimensions, normalize=body.normalize,
                                truncate_prompt_tokens=body.truncate_prompt_tokens)
        inputs = inputs_of(body.input)
        if not body.add_special_tokens:  # text inputs tokenized here, without the tokenizer's BOS
            inputs = [{"prompt": text, "prompt_token_ids": await state.engine.tokenize(text, add_special_tokens=False)}
                      if isinstance(text, str) else text for text in inputs]
        outputs = await pool(state, model, inputs, params, "embd")
        data = [EmbeddingData(index=index, embedding=encoded(output.outputs.data, body.encoding_format))
                for index, output in enumerate(outputs)]
        return EmbeddingResponse(id=f"embd-{uuid.uuid4().hex}", model=model.name, data=data, usage=usage(outputs))

    return await respond(request, body.model, answer)


def encoded(data, encoding_format: str) -> list[float] | list[list[float]] | str:
    """A pooled tensor as JSON numbers (nested for a matrix), or as OpenAI's base64 of its
    little-endian float32 bytes (row after row)."""
    if encoding_format == "base64":
        return base64.b64encode(data.float().numpy().astype("<f4").tobytes()).decode("ascii")
    return data.tolist()


@router.post("/pooling", response_model=PoolingListResponse, responses=RESPONSES)
async def create_pooling(body: PoolingRequest, request: Request) -> Response | BaseModel:
    async def answer(state: ServerState, model: ServedModel) -> PoolingListResponse:
        params = pooling_params(task=body.task, truncate_prompt_tokens=body.truncate_prompt_tokens)
        outputs = await pool(state, model, inputs_of(body.input), params, "pool")
        data = [PoolingData(index=index, data=encoded(output.outputs.data, body.encoding_format))
                for index, output in enumerate(outputs)]
        return PoolingListResponse(id=f"pool-{uuid.uuid4().hex}", model=model.name, data=data, usage=usage(outputs))

    return await respond(request, body.model, answer)


@router.post("/classify", response_model=ClassificationResponse, responses=RESPONSES)
async def create_classification(body: ClassificationRequest, request: Request) -> Response | BaseModel:
    async def answer(state: ServerState, model: ServedModel) -> ClassificationResponse:
        params = pooling_params(task="classify", activation=body.activation,
                                truncate_prompt_tokens=body.truncate_prompt_tokens)
        outputs = await pool(state, model, inputs_of(body.input), params, "classify")
        labels = state.engine.model_config.pooler.labels
        data = [ClassificationData(index=index, label=labels[int(output.outputs.data.argmax())],
                                   probs=output.outputs.data.tolist(), num_classes=len(labels))
                for index, output in enumerate(outputs)]
        return ClassificationResponse(id=f"classify-{uuid.uuid4().hex}", model=model.name, data=data,
                                      usage=usage(outputs))

    return await respond(request, body.model, answer)


@router.post("/score", response_model=ScoreResponse, responses=RESPONSES)
async def create_score(body: ScoreRequest, request: Request) -> Response | BaseModel:
    async def answer(state: ServerState, model: ServedModel) -> ScoreResponse:
        values, tokens = await scores(state, model, body.text_1, body.text_2, body.truncate_prompt_tokens)
        return ScoreResponse(id=f"score-{uuid.uuid4().hex}", model=model.name,
                             data=[ScoreData(index=index, score=value) for index, value in enumerate(values)],
                             usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens))

    return await respond(request, body.model, answer)


@router.post("/rerank", response_model=RerankResponse, responses=RESPONSES)
@router.post("/v1/rerank", response_model=RerankResponse, responses=RESPONSES)
async def create_rerank(body: RerankRequest, request: Request) -> Response | BaseModel:
    async def answer(state: ServerState, model: ServedModel) -> RerankResponse:
        values, tokens = await scores(state, model, body.query, body.documents, body.truncate_prompt_tokens)
        ranked = sorted(range(len(values)), key=lambda index: values[index], reverse=True)[:body.top_n]
        results = [RerankResult(index=index, relevance_score=values[index],
                                document=RerankDocument(text=body.documents[index]) if body.return_documents else None)
                   for index in ranked]
        return RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=model.name, usage=RerankUsage(total_tokens=tokens),
                              results=results)

    return await respond(request, body.model, answer)
