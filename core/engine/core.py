"""The engine core: the scheduler and the executor, stepped one batch at a time.

It takes requests that the input processor has already validated and tokenized, and returns per
step one :class:`EngineCoreOutputs`: for each request that advanced, its new token ids, their
logprobs, any prompt logprobs, and why it finished. It knows no text: stop strings, detokenizing
and ``n > 1`` groups are the output processor's, which asks the core to abort what it stopped.
"""

from __future__ import annotations

import gc
import weakref
from collections import deque
from typing import Any, Iterator

import msgspec

from hookllm.config import EngineConfig, ModelConfig, resolve_device, text_config_of
from hookllm.engine.core_request import EngineCoreRequest
from hookllm.outputs import LogprobsRow
from hookllm.plugins.manager import ActiveHooks
from hookllm.sampling_params import SamplingParams
from hookllm.sched.block_manager import BlockManager
from hookllm.sched.kv_events import KVEventPublisher
from hookllm.sched.output import SchedulerOutput
from hookllm.sched.request import Request, RequestStatus
from hookllm.sched.scheduler import Scheduler, SchedulerStats
from hookllm.worker.executor import Executor, StepResult, make_executor


class EngineCoreOutput(msgspec.Struct, array_like=True, gc=False):
    """What one step did for one request (built for every sampled token: a C struct, cheap to make)."""

    request_id: str
    new_token_ids: list[int]  # empty for a prefill chunk that sampled nothing
    new_logprobs: list[LogprobsRow] | None  # one row per new token, when logprobs were asked for
    new_prompt_logprobs: list[LogprobsRow] | None  # this step's prompt chunk, when asked for
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    stop_reason: int | None  # the stop token id that ended it
    num_cached_tokens: int  # prompt tokens found in the prefix cache at first admission
    pooled: Any = None  # a pooling request's output (a host float32 tensor), in the step that ends it
    num_draft_tokens: int = 0  # speculative decoding: the guesses this step verified for it
    num_accepted_tokens: int = 0  # ... and those it kept


class EngineCoreOutputs(msgspec.Struct, array_like=True, gc=False):
    outputs: list[EngineCoreOutput]
    first_scheduled: list[str]  # requests scheduled for the first time in this step


NO_OUTPUTS = EngineCoreOutputs([], [])


def eos_token_ids(model_config: ModelConfig, tokenizer: Any | None) -> set[int]:
    """EOS ids from config.json (possibly several), generation_config.json and the tokenizer."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    sources = [model_config.hf_config, text_config_of(model_config.hf_config)]
    try:
        sources.append(GenerationConfig.from_pretrained(model_config.path))
    except OSError:
        pass  # the checkpoint has no generation_config.json
    if tokenizer is not None:
        sources.append(tokenizer)
    for source in sources:
        eos = getattr(source, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    return ids


class EngineCore:
    """The scheduler, the KV blocks and the worker (or the rank processes) of one engine."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, hooks: ActiveHooks, tokenizer: Any | None):
        # One rank: the worker lives here, unless asked to run apart. Several: one process per
        # rank, fed the same snapshots.
        self.executor: Executor = make_executor(config, model_config, hooks)
        # A pooling request reads the hidden states of every prompt token, so it never looks up a
        # cached prefix: a pooling engine would only hash blocks that nothing ever finds.
        prefix_caching = config.enable_prefix_caching and model_config.runner != "pooling"
        block_manager = BlockManager(self.executor.num_kv_blocks, config.block_size, prefix_caching,
                                     self.executor.kv_cache_groups.windows)
        # Every change to scheduling state (requests, blocks) goes through the scheduler's methods.
        self.scheduler = Scheduler(block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   eos_token_ids(model_config, tokenizer), config.preemption_mode,
                                   self.executor.num_host_blocks,
                                   pipeline_depth=config.pipeline_parallel_size,
                                   chunked_prefill=not model_config.encoder,
                                   max_loras=config.max_loras if config.enable_lora else 0,
                                   speculative_config=config.speculative_config,
                                   num_lookahead_tokens=(config.speculative_config.num_speculative_tokens
                                                         if model_config.spec_draft is not None else 0))
        # KV-cache events for prefix-aware routers: the block manager records them, each step publishes.
        events_config = config.kv_events_config
        self.kv_event_publisher: KVEventPublisher | None = None
        if events_config is not None and events_config.enable_kv_cache_events:
            self.kv_event_publisher = KVEventPublisher(events_config)
            block_manager.kv_events = []
        # Launched steps whose tokens are not read yet: at most one more than max_in_flight.
        self.in_flight: deque[tuple[SchedulerOutput, StepResult]] = deque()
        async_scheduling = config.async_scheduling
        if async_scheduling is None:
            async_scheduling = resolve_device(config.device).type == "cuda"
        # Pipeline stages: one batch per stage in flight, so no stage waits for the others.
        self.max_in_flight = (1 if async_scheduling else 0) + config.pipeline_parallel_size - 1
        # What exists now (model, tokenizer, plugins) lives as long as the engine: move it out of
        # the garbage collector's sight, or each full collection walks it all, mid-step. Frozen
        # objects are never collected, so they go back to the collector when this engine core is
        # dropped: its model's reference cycles (GPU memory and all) are then freed by the next
        # collection instead of outliving it, and an engine built after it finds the memory free.
        gc.collect()
        gc.freeze()
        weakref.finalize(self, gc.unfreeze)

    @property
    def eos_token_ids(self) -> set[int]:
        return self.scheduler.eos_token_ids

    def add_requests(self, request_id: str, requests: list[EngineCoreRequest]) -> None:
        """Queue the engine requests of the user's request ``request_id``: itself, or its ``n``
        children, which share the prompt's cached blocks. ``ValueError`` if together they could
        never fit in the cache."""
        self.scheduler.add_requests(request_id, requests)

    def retain_blocks(self, request_id: str) -> None:
        """Keep the request's KV blocks once it finishes, for ``fork_request``, until ``release_request``."""
        self.scheduler.retain_blocks(request_id)

    def fork_request(self, parent_id: str, request_id: str, token_ids: list[int], params: SamplingParams,
                     max_model_len: int) -> EngineCoreRequest:
        """Queue a request continuing the computed tokens of ``parent_id`` (finished, its blocks
        retained) with ``token_ids``, sharing the parent's KV blocks; returns it."""
        parent = self.scheduler.retained[parent_id]
        child = EngineCoreRequest(request_id, parent.all_token_ids[:parent.num_computed_tokens] + list(token_ids),
                                  params, multi_modal_data=parent.multi_modal_data, mm_items=parent.mm_items,
                                  cache_salt=parent.cache_salt, lora_request=parent.lora_request)
        child.set_length_limit(max_model_len)
        self.scheduler.fork(parent_id, child)
        return child

    def release_request(self, request_id: str) -> None:
        """Free the KV blocks a finished request kept for forks; unknown ids pass."""
        self.scheduler.release(request_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        """End requests now and free their blocks; unknown or finished ids pass."""
        for request_id in request_ids:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self._release_finished_if_idle()

    def drop_in_flight(self) -> None:
        """Forget launched steps whose tokens are not read yet (after a failed step: their
        requests are aborted, and nothing is left to read)."""
        self.in_flight.clear()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.in_flight)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while requests hold KV blocks."""
        reset = not self.in_flight and self.scheduler.reset_prefix_cache()
        self._publish_kv_events()  # routers learn of it now, not at the next step
        return reset

    def step(self) -> EngineCoreOutputs:
        """Schedule and launch one batch; return what the last finished step produced.

        With async scheduling that is the previous batch: its tokens are read back while the
        device runs this one, so host work overlaps the device's.
        """
        if self.in_flight and self.scheduler.speculates():
            # A step that speculates proposes from every token before it: read the steps in flight first.
            return self._finish_step(self._update(*self.in_flight.popleft()))
        batch = self.scheduler.schedule()
        previous = self.in_flight[-1][1] if self.in_flight else None
        # A step may only swap out (its one request could not grow): the worker still copies.
        needs_worker = not batch.is_empty() or batch.finished_request_ids or batch.swap_out
        result = self.executor.execute(batch, previous) if needs_worker else None
        if result is not None:
            self.in_flight.append((batch, result))
        outputs = NO_OUTPUTS
        # A speculating step is read at once: the next one schedules the drafts it proposed.
        if self.in_flight and (len(self.in_flight) > self.max_in_flight or result is None or batch.speculates):
            outputs = self._update(*self.in_flight.popleft())
        return self._finish_step(outputs)

    def _finish_step(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        self._release_finished_if_idle()
        self._publish_kv_events()
        return outputs

    def _publish_kv_events(self) -> None:
        """Publish what the block manager recorded since the last call, as one batch."""
        if self.kv_event_publisher is not None:
            events = self.scheduler.block_manager.take_kv_events()
            if events:
                self.kv_event_publisher.publish(events)

    def _update(self, batch: SchedulerOutput, result: StepResult) -> EngineCoreOutputs:
        """A finished step: the scheduler takes its tokens; each request that advanced reports."""
        prompt_logprobs = result.prompt_logprobs()
        outputs = []
        for request, token_ids, logprobs, drafted, accepted in self._sampled_tokens(batch, result):
            outputs.append(EngineCoreOutput(
                request.request_id, token_ids, logprobs,
                prompt_logprobs.pop(request.request_id, None) if prompt_logprobs else None,
                request.status.value if request.is_finished else None, request.stop_reason,
                request.num_cached_tokens or 0, None, drafted, accepted))
        if batch.pooling_rows:
            pooled = result.pooled()
            outputs += [EngineCoreOutput(request.request_id, [], None, None, request.status.value, None,
                                         request.num_cached_tokens or 0, pooled[request.request_id])
                        for request in self.scheduler.finish_pooled(batch)]
        # Prefill chunks that sampled nothing still carry their prompt logprobs.
        for request_id, entries in prompt_logprobs.items():
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                outputs.append(EngineCoreOutput(request_id, [], None, entries, None, None,
                                                request.num_cached_tokens or 0))
        return EngineCoreOutputs(outputs, [new.request_id for new in batch.new_requests])

    def _sampled_tokens(self, batch: SchedulerOutput, result: StepResult
                        ) -> Iterator[tuple[Request, list[int], list[LogprobsRow] | None, int, int]]:
        """Each request that took tokens from the step: those tokens, their logprobs rows (None
        when not asked), and the guesses it verified and kept (speculative decoding)."""
        if batch.speculates:
            spec = result.spec_decode()
            for request, row, taken in self.scheduler.update_from_spec_output(batch, spec.token_ids,
                                                                               spec.draft_token_ids):
                rows = spec.logprobs[row][:taken]
                drafted = len(batch.spec_token_ids.get(request.request_id, ()))
                yield (request, spec.token_ids[row][:taken], None if rows[0] is None else rows, drafted,
                       len(spec.token_ids[row]) - 1 if drafted else 0)
            return
        token_ids, logprobs = result.resolve()
        for request, row in self.scheduler.update_from_output(batch, token_ids):
            logprobs_row = logprobs[row]
            yield request, [token_ids[row]], None if logprobs_row is None else [logprobs_row], 0, 0

    def _release_finished_if_idle(self) -> None:
        """Finished requests reach the worker with the next batch; with none coming, send them now
        (plugins free what they keep per request in ``worker_request_finished``)."""
        if self.scheduler.finished_request_ids and not self.in_flight and not self.scheduler.has_unfinished():
            self.executor.execute(SchedulerOutput.empty(self.scheduler.take_finished_request_ids()))

    def shutdown(self) -> None:
        """Abort every request and stop the worker (its processes under tensor parallelism)."""
        self.abort_requests(list(self.scheduler.requests))
        self.in_flight.clear()
        self.executor.shutdown()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()
