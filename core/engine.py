"""LLMEngine: requests in, one scheduling + execution step at a time, RequestOutputs out."""

from __future__ import annotations

import itertools
import json
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterable

import torch

from hookllm.block_manager import BlockManager
from hookllm.config import EngineConfig, ModelConfig, resolve_device, resolve_dtype, text_config_of
from hookllm.model_runner import StepOutput
from hookllm.outputs import CompletionOutput, RequestOutput
from hookllm.plugins.manager import PluginManager
from hookllm.request import Request, RequestStatus
from hookllm.sampling_params import SamplingParams
from hookllm.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from hookllm.tokenizer import IncrementalDetokenizer, load_tokenizer
from hookllm.worker import Worker


class LLMEngine:
    def __init__(self, config: EngineConfig, plugin_manager: PluginManager | None = None):
        self.config = config
        self.plugin_manager = plugin_manager or PluginManager()
        selected = self.plugin_manager.check_selected(config.plugins)
        device = resolve_device(config.device)
        self.model_config = ModelConfig.from_path(
            config.model, resolve_dtype(config.dtype, device), config.max_model_len
        )
        owner = self.plugin_manager.model_owner(self.model_config.architecture, selected)
        self.model_config.plugin = owner
        active = selected + ([owner] if owner not in selected else [])
        self.hooks = self.plugin_manager.active_hooks(active)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.worker = Worker(config, self.model_config, self.hooks, self.plugin_manager.registry)
        self.block_manager = BlockManager(self.worker.num_kv_blocks, config.block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.generator = torch.Generator(device=device).manual_seed(config.seed)
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self.eos_token_ids = self._eos_token_ids()
        # Launched steps whose tokens are not read yet: at most one more than max_in_flight.
        self.in_flight: deque[tuple[SchedulerOutput, StepOutput]] = deque()
        async_scheduling = config.async_scheduling if config.async_scheduling is not None else device.type == "cuda"
        self.max_in_flight = 1 if async_scheduling else 0

    @property
    def active_plugins(self) -> list[str]:
        return self.hooks.plugin_names

    def _eos_token_ids(self) -> set[int]:
        """EOS ids from config.json (possibly several), generation_config.json and the tokenizer."""
        ids: set[int] = set()
        sources = [self.model_config.hf_config, text_config_of(self.model_config.hf_config)]
        generation_config = Path(self.config.model) / "generation_config.json"
        if generation_config.exists():
            sources.append(SimpleNamespace(**json.loads(generation_config.read_text())))
        for source in sources:
            eos = getattr(source, "eos_token_id", None)
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def add_request(
        self, request_id: str, prompt: str | dict[str, Any] | list[int], params: SamplingParams | None = None
    ) -> str:
        """Tokenize, let plugins preprocess, check limits, and queue (vLLM's argument order).

        Bad input raises ``ValueError`` naming the request; nothing of it stays behind.
        """
        if not isinstance(request_id, str):
            raise TypeError(
                f"add_request takes (request_id, prompt, params) in vLLM's order; the request id must be "
                f"a str, got {type(request_id).__name__}"
            )
        if isinstance(prompt, SamplingParams) or not isinstance(params, (SamplingParams, type(None))):
            raise TypeError("add_request takes (request_id, prompt, params) in vLLM's order, "
                            f"got a {type(prompt).__name__} as the prompt and a {type(params).__name__} as params")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self._make_request(prompt, params or SamplingParams(), request_id)
        self.hooks.hook.preprocess_request(request=request, tokenizer=self.tokenizer, model_config=self.model_config)
        if request.multi_modal_data and any(request.multi_modal_data.values()) and not request.mm_items:
            raise ValueError(
                f"request {request_id}: no active plugin takes multi_modal_data "
                f"({', '.join(sorted(request.multi_modal_data))}); select one with --plugin"
            )
        self._check_limits(request)
        if self.tokenizer is not None:
            self.detokenizers[request_id] = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, request.sampling_params.skip_special_tokens
            )
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def _make_request(self, prompt: Any, params: SamplingParams, request_id: str) -> Request:
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        elif isinstance(prompt, (list, tuple)):
            prompt = {"prompt_token_ids": list(prompt)}
        if not isinstance(prompt, dict):
            raise ValueError(f"request {request_id}: a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
        if unknown:
            raise ValueError(f"request {request_id}: unknown prompt fields {sorted(unknown)}")
        text = prompt.get("prompt")
        token_ids = prompt.get("prompt_token_ids")
        if token_ids is None:
            if text is None:
                raise ValueError(f"request {request_id}: give 'prompt' or 'prompt_token_ids'")
            if self.tokenizer is None:
                raise ValueError(
                    f"request {request_id}: {self.config.model} has no tokenizer files; pass prompt_token_ids"
                )
            token_ids = self.tokenizer(text)["input_ids"] if text else []
        token_ids = [int(t) for t in token_ids]
        vocab = getattr(text_config_of(self.model_config.hf_config), "vocab_size", None)
        if vocab is not None and any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"request {request_id}: prompt token ids must be in [0, {vocab})")
        return Request(request_id, token_ids, params, prompt=text,
                       multi_modal_data=prompt.get("multi_modal_data"))

    def _check_limits(self, request: Request) -> None:
        rid, n = request.request_id, request.num_prompt_tokens
        max_len = self.model_config.max_model_len
        if n == 0:
            raise ValueError(f"request {rid}: the prompt is empty")
        if n >= max_len:
            raise ValueError(f"request {rid}: the prompt has {n} tokens, max_model_len is {max_len} "
                             "(it must leave room for at least one output token)")
        max_tokens = request.sampling_params.max_tokens
        request.max_num_tokens = min(n + max_tokens, max_len) if max_tokens is not None else max_len
        needed = self.block_manager.blocks_needed(request.max_num_tokens)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"request {rid}: prompt plus max_tokens ({request.max_num_tokens} tokens) needs {needed} KV "
                f"blocks, but the cache has only {self.block_manager.num_blocks} blocks of {self.config.block_size}"
            )

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests now and free their KV blocks; unknown or finished ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            request = self.requests.get(rid)
            if request is not None and not request.is_finished:
                self._finish(request, RequestStatus.FINISHED_ABORTED)

    def get_stats(self) -> SchedulerStats:
        """Running and waiting requests and KV-cache use now (for metrics)."""
        return self.scheduler.stats()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.in_flight)

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one batch; return an output for every request that advanced.

        With async scheduling the outputs are those of the previous batch: its tokens are read
        back while the device runs this one, so host work overlaps the device's.
        """
        batch = self.scheduler.schedule()
        if not batch.is_empty():
            batch.generator = self.generator
            self.in_flight.append((batch, self.worker.execute(batch)))
            for request, n in zip(batch.requests, batch.num_scheduled_tokens):
                request.num_computed_tokens += n
            for request in batch.sampling_requests:
                request.num_output_placeholders += 1
        if len(self.in_flight) > self.max_in_flight or (batch.is_empty() and self.in_flight):
            return self._process(*self.in_flight.popleft())
        return []

    def _process(self, batch: SchedulerOutput, result: StepOutput) -> list[RequestOutput]:
        """Append a finished step's sampled tokens, apply stop conditions, build outputs."""
        outputs = []
        token_ids, logprobs_per_row = result.resolve()
        for request, token_id, logprobs in zip(batch.sampling_requests, token_ids, logprobs_per_row):
            request.num_output_placeholders -= 1
            if request.is_finished:
                continue  # stopped or aborted while this step ran: its extra token is dropped
            text_before = len(request.output_text)
            self._append_token(request, token_id, logprobs)
            kind = request.sampling_params.output_kind
            if kind != "final_only" or request.is_finished:
                outputs.append(self._make_output(request, text_before if kind == "delta" else None))
            if request.is_finished:
                self._release(request)
        return outputs

    def _append_token(self, request: Request, token_id: int, logprobs: dict[int, float] | None) -> None:
        params = request.sampling_params
        request.append_output_token(token_id)
        if logprobs is not None:
            request.logprobs.append(logprobs)
        num_out = len(request.output_token_ids)
        stop_token = (token_id in params.stop_token_ids
                      or (not params.ignore_eos and token_id in self.eos_token_ids))
        if stop_token and num_out >= params.min_tokens:
            request.stop_reason = token_id if token_id in params.stop_token_ids else None
            self._finish(request, RequestStatus.FINISHED_STOPPED)
            return
        detokenizer = self.detokenizers.get(request.request_id)
        if detokenizer is not None:
            previous_len = len(request.output_text)
            request.output_text += detokenizer.add(token_id)
            if params.stop and num_out >= params.min_tokens and self._check_stop_strings(request, previous_len):
                return
        if len(request.all_token_ids) >= request.max_num_tokens:  # max_tokens or max_model_len
            self._finish(request, RequestStatus.FINISHED_LENGTH)

    def _check_stop_strings(self, request: Request, previous_len: int) -> bool:
        params = request.sampling_params
        text = request.output_text
        for stop in params.stop:
            # Only a match that ends in the new text is new; search from just before it.
            index = text.find(stop, max(0, previous_len - len(stop) + 1))
            if index != -1:
                request.output_text = text[: index + len(stop)] if params.include_stop_str_in_output else text[:index]
                request.stop_reason = stop
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                return True
        return False

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish(request, status)
        if status is RequestStatus.FINISHED_ABORTED:
            self._release(request)

    def _release(self, request: Request) -> None:
        """Forget a finished request and let plugins free what they keep for it."""
        self.requests.pop(request.request_id, None)
        self.detokenizers.pop(request.request_id, None)
        self.hooks.hook.request_finished(request=request, model=self.worker.model)

    def _make_output(self, request: Request, delta_from: int | None = None) -> RequestOutput:
        """The request's output so far, or with ``delta_from`` only this step's token and new text."""
        finish_reason = request.status.value if request.is_finished else None
        if delta_from is None:
            text, token_ids, logprobs = request.output_text, list(request.output_token_ids), request.logprobs
        else:
            text, token_ids, logprobs = (request.output_text[delta_from:], request.output_token_ids[-1:],
                                         request.logprobs[-1:] if request.logprobs is not None else None)
        completion = CompletionOutput(
            index=0, text=text, token_ids=token_ids, finish_reason=finish_reason, stop_reason=request.stop_reason,
            logprobs=list(logprobs) if logprobs is not None else None,
        )
        return RequestOutput(request.request_id, request.prompt, list(request.prompt_token_ids),
                             [completion], request.is_finished)
