"""What crosses between an engine loop and its clients (a pipe to an engine process, or a queue
to an engine thread): typed messages, each a ``msgspec.Struct``.

Reports, one per client per step, cross the pipe as msgpack (``encode_report`` /
``decode_report``): a step's 256 one-token outputs encode and decode in about 0.5 us each, less
than pickling bare tuples. Commands are rarer and carry arbitrary prompts (images), so they are
pickled. A request's prompt crosses once, with its first output (``PromptHead``); the client
rebuilds ``RequestOutput``s (``OutputStream.unpack``) in the consumer, after merging the deltas
that piled up (``merge_deltas``).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec
import numpy as np
import torch

from hookllm.lora.request import LoRARequest
from hookllm.outputs import (CompletionOutput, FlatLogprobs, Logprob, PoolingOutput, PoolingRequestOutput,
                             RequestMetrics, RequestOutput)
from hookllm.pooling_params import PoolingParams
from hookllm.sampling_params import SamplingParams
from hookllm.sched.scheduler import SchedulerStats
from hookllm.tokenizer import TokenTexts

# Plain data without reference cycles: the garbage collector need not track them.
STRUCT_OPTIONS = {"array_like": True, "gc": False}


# --- client to engine ----------------------------------------------------------------------------

class AddRequest(msgspec.Struct):
    request_id: str
    prompt: Any
    params: SamplingParams | PoolingParams
    lora_request: LoRARequest | None = None


class AbortRequests(msgspec.Struct):
    request_ids: list[str]


class Shutdown(msgspec.Struct):
    """This client is done: its requests are aborted; the loop stops once every client is."""


Command = Union[AddRequest, AbortRequests, Shutdown]


# --- engine to client ----------------------------------------------------------------------------

class PromptHead(msgspec.Struct, **STRUCT_OPTIONS):
    """What a request's first output carries once: its prompt and what the prompt got."""

    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    num_cached_tokens: int
    lora_request: LoRARequest | None


class CompletionDelta(msgspec.Struct, **STRUCT_OPTIONS):
    """A ``CompletionOutput``'s fields, in its order."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: FlatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class OutputDelta(msgspec.Struct, **STRUCT_OPTIONS):
    """One request's output of one step (the prompt only in its first, as ``head``)."""

    request_id: str
    finished: bool
    head: PromptHead | None
    completions: list[CompletionDelta]
    metrics: RequestMetrics | None  # a finished request's


class PooledOutput(msgspec.Struct, **STRUCT_OPTIONS):
    """A pooling request's one output: its float32 data as bytes, with the data's shape."""

    request_id: str
    prompt_token_ids: list[int]
    shape: list[int]
    data: bytes
    num_cached_tokens: int


class RequestAdded(msgspec.Struct, **STRUCT_OPTIONS):
    request_id: str
    error: tuple[str, str] | None = None  # (exception type name, message) if refused


class EngineReport(msgspec.Struct, **STRUCT_OPTIONS):
    """What one turn of the loop tells a client."""

    stats: SchedulerStats
    outputs: list[OutputDelta] = []
    added: list[RequestAdded] = []
    # A failed step: the requests it failed and why.
    failed_ids: list[str] = []
    failure: str = ""
    closed: bool = False  # the last report: the loop has stopped and aborted what was left
    pooled: list[PooledOutput] = []  # pooling requests that finished


encode_report = msgspec.msgpack.Encoder().encode
decode_report = msgspec.msgpack.Decoder(EngineReport).decode


def pack_output(output: RequestOutput, with_head: bool) -> OutputDelta:
    head = (PromptHead(output.prompt, output.prompt_token_ids, output.prompt_logprobs, output.num_cached_tokens,
                       output.lora_request) if with_head else None)
    completions = [CompletionDelta(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason,
                                   c.stop_reason) for c in output.outputs]
    return OutputDelta(output.request_id, output.finished, head, completions,
                       output.metrics if output.finished else None)


def pack_pooled(output: PoolingRequestOutput) -> PooledOutput:
    data = output.outputs.data.float().contiguous()
    return PooledOutput(output.request_id, output.prompt_token_ids, list(data.shape), data.numpy().tobytes(),
                        output.num_cached_tokens)


def unpack_pooled(pooled: PooledOutput) -> PoolingRequestOutput:
    data = torch.from_numpy(np.frombuffer(pooled.data, dtype=np.float32).reshape(pooled.shape).copy())
    return PoolingRequestOutput(pooled.request_id, PoolingOutput(data), pooled.prompt_token_ids, True,
                                pooled.num_cached_tokens)


def merge_deltas(first: OutputDelta, later: OutputDelta) -> OutputDelta:
    """Two consecutive delta outputs of one request as one: ``later``'s state with both steps'
    new text, token ids and logprobs (and the head, which only a request's first output has)."""
    merged = {c.index: c for c in first.completions}
    for c in later.completions:
        old = merged.get(c.index)
        if old is not None:
            logprobs = old.logprobs + c.logprobs if old.logprobs is not None and c.logprobs is not None else c.logprobs
            c = msgspec.structs.replace(c, text=old.text + c.text, token_ids=old.token_ids + c.token_ids,
                                        logprobs=logprobs)
        merged[c.index] = c
    return msgspec.structs.replace(later, head=first.head if first.head is not None else later.head,
                                   completions=[merged[i] for i in sorted(merged)])


class OutputStream:
    """The client's side of one request: puts its deltas back into ``RequestOutput``s, whose
    logprobs' texts ``token_texts`` (the client's own) looks up when they are read."""

    def __init__(self, token_texts: TokenTexts | None) -> None:
        self.head: PromptHead | None = None
        self.token_texts = token_texts

    def unpack(self, delta: OutputDelta) -> RequestOutput:
        if delta.head is not None:
            self.head = delta.head
        head = self.head
        completions = [CompletionOutput(*msgspec.structs.astuple(c)) for c in delta.completions]
        for completion in completions:
            if completion.logprobs is not None:
                completion.logprobs.decode_with(self.token_texts)
        return RequestOutput(delta.request_id, head.prompt, head.prompt_token_ids, completions, delta.finished,
                             head.prompt_logprobs, delta.metrics, head.num_cached_tokens, head.lora_request)


def rebuild_error(error: tuple[str, str]) -> Exception:
    """An exception raised in the engine, as the client raises it: bad input stays a ValueError."""
    name, message = error
    kinds = {"ValueError": ValueError, "TypeError": TypeError}
    return kinds[name](message) if name in kinds else RuntimeError(f"{name}: {message}")
