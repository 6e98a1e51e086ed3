"""LLMEngine: requests in, one scheduling + execution step at a time, RequestOutputs out."""

from __future__ import annotations

import dataclasses
import gc
import numbers
import warnings
from collections import deque
from typing import TYPE_CHECKING, Any, Iterable

from hookllm.sched.block_manager import BlockManager
from hookllm.config import EngineConfig, ModelConfig, resolve_device, text_config_of
from hookllm.worker.model_runner import StepOutput
from hookllm.worker.multiproc_executor import MultiprocWorkers
from hookllm.engine.output_processor import OutputProcessor
from hookllm.outputs import RequestOutput
from hookllm.plugins.manager import PluginManager
from hookllm.sched.request import ParallelGroup, Request, RequestStatus
from hookllm.sampling_params import SamplingParams
from hookllm.sched.scheduler import Scheduler, SchedulerStats
from hookllm.sched.output import SchedulerOutput
from hookllm.tokenizer import load_tokenizer
from hookllm.worker.worker import Worker, resolve_model

if TYPE_CHECKING:
    from hookllm.engine.arg_utils import EngineArgs


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


class LLMEngine:
    """Requests in, one step at a time, ``RequestOutput``s out.

    A step is: the scheduler decides the batch (a plain snapshot), the worker runs it, and the
    scheduler applies the sampled tokens; the output processor turns them into text.
    """

    def __init__(self, config: EngineConfig, plugin_manager: PluginManager | None = None):
        from hookllm.hub import with_local_paths

        # A hub id ("org/name") becomes its local snapshot folder before anything reads it.
        config = with_local_paths(config)
        self.config = config
        self.plugin_manager = plugin_manager or PluginManager()
        self.model_config, self.hooks = resolve_model(config, self.plugin_manager)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        # One rank: the worker lives here. Several: one process per rank, fed the same snapshots.
        self.worker = (Worker(config, self.model_config, self.hooks, self.plugin_manager.registry)
                       if config.tensor_parallel_size == 1 else MultiprocWorkers(config))
        self.block_manager = BlockManager(self.worker.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   eos_token_ids(self.model_config, self.tokenizer),
                                   config.preemption_mode, self.worker.num_host_blocks)
        self.output_processor = OutputProcessor(self.tokenizer)
        # Launched steps whose tokens are not read yet: at most one more than max_in_flight.
        self.in_flight: deque[tuple[SchedulerOutput, StepOutput]] = deque()
        device = resolve_device(config.device)
        async_scheduling = config.async_scheduling if config.async_scheduling is not None else device.type == "cuda"
        self.max_in_flight = 1 if async_scheduling else 0
        # Requests with n > 1 by id, and each child's parent.
        self.parallel: dict[str, ParallelGroup] = {}
        self.parent_of: dict[str, str] = {}
        # What exists now (model, tokenizer, plugins) lives as long as the engine: move it out of
        # the garbage collector's sight, or each full collection walks it all, mid-step.
        gc.collect()
        gc.freeze()

    @classmethod
    def from_engine_args(cls, engine_args: "EngineArgs") -> "LLMEngine":
        """vLLM's constructor: an engine from :class:`hookllm.engine.arg_utils.EngineArgs`."""
        return cls(engine_args.create_engine_config())

    @property
    def active_plugins(self) -> list[str]:
        return self.hooks.plugin_names

    def get_tokenizer(self) -> Any | None:
        """The checkpoint's tokenizer (None when the checkpoint has none)."""
        return self.tokenizer

    def get_model_config(self) -> ModelConfig:
        return self.model_config

    def get_num_unfinished_requests(self) -> int:
        """Requests queued or running (a finished request awaiting its last output is not counted)."""
        return len(self.scheduler.requests)

    def shutdown(self) -> None:
        """Abort every request, stop the worker (its processes under tensor parallelism) and drop
        the model and KV cache; the engine cannot be used after, and a second call does nothing.
        ``hookllm.distributed.cleanup_dist_env_and_memory()`` then returns the memory."""
        if "worker" not in self.__dict__:
            return
        self.abort_request(list(self.scheduler.requests))
        self.in_flight.clear()
        self.worker.shutdown()
        for attr in ("worker", "scheduler", "block_manager", "output_processor", "in_flight"):
            self.__dict__.pop(attr, None)

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
        if self.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        params = self._check_params(request_id, params or SamplingParams())
        request = self._make_request(prompt, params, request_id)
        self.hooks.hook.preprocess_request(request=request, tokenizer=self.tokenizer, model_config=self.model_config)
        if request.multi_modal_data and any(request.multi_modal_data.values()) and not request.mm_items:
            raise ValueError(
                f"request {request_id}: no active plugin takes multi_modal_data "
                f"({', '.join(sorted(request.multi_modal_data))}); select one with --plugin"
            )
        # An active plugin that enforces structured_outputs takes it off the request's params.
        left = request.sampling_params
        if left.structured_outputs is not None or "structured_outputs" in left.extra_args:
            raise ValueError(f"request {request_id}: no active plugin enforces structured_outputs; select the "
                             "structured output plugin with --plugin structured / LLM(plugins=['structured'])")
        self._check_limits(request)
        for child in self._fan_out(request):
            self.output_processor.add_request(child)
            self.scheduler.add(child)
        return request_id

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` names an unfinished request."""
        return request_id in self.scheduler.requests or request_id in self.parallel

    def _fan_out(self, request: Request) -> list[Request]:
        """The requests to queue: the request itself, or its ``n`` children (see ParallelGroup),
        after checking the children ids are free and the n children fit the cache together."""
        params = request.sampling_params
        if params.n == 1:
            return [request]
        rid = request.request_id
        group = ParallelGroup(rid, params.n, params.output_kind)
        taken = [child_id for child_id in group.child_ids if self.has_request(child_id)]
        if taken:
            raise ValueError(f"request {rid}: n={params.n} needs the child ids {taken} that are in use")
        manager = self.block_manager
        shared = (request.num_prompt_tokens // manager.block_size) if manager.enable_prefix_caching else 0
        needed = shared + params.n * (manager.blocks_needed(request.max_num_tokens) - shared)
        if needed > manager.num_blocks:
            raise ValueError(
                f"request {rid}: n={params.n} completions of up to {request.max_num_tokens} tokens need {needed} KV "
                f"blocks together, but the cache has only {manager.num_blocks}"
            )
        children = []
        for i, child_id in enumerate(group.child_ids):
            # Child i draws from seed + i: the same n completions alone or in any batch.
            child_params = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            child = Request(child_id, request.prompt_token_ids, child_params, request.prompt,
                            request.multi_modal_data, request.mm_items, request.cache_salt)
            child.max_num_tokens = request.max_num_tokens
            children.append(child)
            self.parent_of[child_id] = rid
        self.parallel[rid] = group
        return children

    def fork_request(self, parent_id: str, request_id: str, token_ids: list[int], params: SamplingParams) -> str:
        """Queue a request continuing the computed tokens of ``parent_id`` (a finished request whose
        ``retain_blocks`` was set) with ``token_ids``, sharing the parent's KV blocks (beam search)."""
        parent = self.scheduler.retained[parent_id]
        if self.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        child = Request(request_id, parent.all_token_ids[:parent.num_computed_tokens] + list(token_ids), params,
                        multi_modal_data=parent.multi_modal_data, mm_items=parent.mm_items,
                        cache_salt=parent.cache_salt)
        child.retain_blocks = parent.retain_blocks
        self._check_limits(child)
        self.output_processor.add_request(child)
        self.scheduler.fork(parent_id, child)
        return request_id

    def release_request(self, request_id: str) -> None:
        """Free the KV blocks a finished request kept for forks."""
        self.scheduler.release(request_id)

    def _check_params(self, request_id: str, params: SamplingParams) -> SamplingParams:
        """Resolve what needs the tokenizer or the plugins (bad words' tokens; extra_args keys of
        inactive plugins warn). Returns the request's own copy: the user's object is not changed."""
        inactive = self._inactive_plugin_options()
        for key, value in params.extra_args.items():
            if key in inactive and value != inactive[key][1]:  # its default is what the CLI passes unasked
                name = inactive[key][0]
                warnings.warn(f"request {request_id}: extra_args key {key!r} belongs to plugin {name!r}, which is "
                              f"not active; select it with --plugin {name} / LLM(plugins=[{name!r}])", stacklevel=3)
        if not params.bad_words:
            return params
        if self.tokenizer is None:
            raise ValueError(f"request {request_id}: bad_words needs a tokenizer; {self.config.model} has none")
        params = params.clone()
        spellings: list[list[int]] = []
        for word in params.bad_words:
            # A word inside text usually follows a space: ban both spellings (as vLLM does).
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in spellings:
                    spellings.append(ids)
        params.bad_words_token_ids = spellings
        return params

    def _inactive_plugin_options(self) -> dict[str, tuple[str, Any]]:
        """The ``add_cli_options`` dests of installed plugins that are not active: (plugin, default)."""
        if not hasattr(self, "_inactive_options"):
            import argparse

            self._inactive_options = {}
            active = set(self.active_plugins)
            for info in self.plugin_manager.loaded():
                if info.name in active or not hasattr(info.module, "add_cli_options"):
                    continue
                parser = argparse.ArgumentParser(add_help=False)
                info.module.add_cli_options(parser=parser)
                self._inactive_options.update({action.dest: (info.name, action.default) for action in parser._actions})
        return self._inactive_options

    def _make_request(self, prompt: Any, params: SamplingParams, request_id: str) -> Request:
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        elif isinstance(prompt, (list, tuple)):
            prompt = {"prompt_token_ids": list(prompt)}
        if not isinstance(prompt, dict):
            raise ValueError(f"request {request_id}: a prompt is a string, a list of token ids or a dict, got "
                             f"{type(prompt).__name__}")
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data", "cache_salt"}
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
        elif not isinstance(token_ids, (list, tuple)):
            raise ValueError(f"request {request_id}: prompt_token_ids must be a list of ints, "
                             f"got {type(token_ids).__name__}")
        # Never coerced: 1.5, "3", None or True in a prompt is a bug in the caller.
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        if bad:
            raise ValueError(f"request {request_id}: prompt_token_ids must be ints, got {bad[0]!r}")
        token_ids = [int(t) for t in token_ids]
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens:]  # vLLM keeps the prompt's end
        vocab = getattr(text_config_of(self.model_config.hf_config), "vocab_size", None)
        if vocab is not None and any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"request {request_id}: prompt token ids must be in [0, {vocab})")
        return Request(request_id, token_ids, params, prompt=text,
                       multi_modal_data=prompt.get("multi_modal_data"), cache_salt=prompt.get("cache_salt"))

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
            group = self.parallel.pop(rid, None)
            for child_id in group.child_ids if group is not None else [rid]:
                self.parent_of.pop(child_id, None)
                self.scheduler.finish_request(child_id, RequestStatus.FINISHED_ABORTED)
                self.output_processor.remove_request(child_id)
        self._release_finished_if_idle()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while requests hold KV blocks."""
        if self.has_unfinished_requests() or self.scheduler.retained:
            return False
        self.block_manager.reset_prefix_cache()
        return True

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
        previous = self.in_flight[-1][1] if self.in_flight else None
        # A step may only swap out (its one request could not grow): the worker still copies.
        needs_worker = not batch.is_empty() or batch.finished_request_ids or batch.swap_out
        result = self.worker.execute(batch, previous) if needs_worker else None
        if result is not None:
            self.in_flight.append((batch, result))
        outputs = []
        if len(self.in_flight) > self.max_in_flight or (result is None and self.in_flight):
            outputs = self._process(*self.in_flight.popleft())
        self._release_finished_if_idle()
        return outputs

    def _process(self, batch: SchedulerOutput, result: StepOutput) -> list[RequestOutput]:
        """A finished step: the scheduler takes its tokens; the output processor makes the text."""
        token_ids, logprobs = result.resolve()
        self.output_processor.mark_scheduled([new.request_id for new in batch.new_requests])
        for request_id, entries in result.prompt_logprobs().items():
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                self.output_processor.add_prompt_logprobs(request, entries)
        outputs = []
        for request, row in self.scheduler.update_from_output(batch, token_ids):
            stop = self.output_processor.append_token(request, logprobs[row])
            if stop is not None:
                self.scheduler.stop_on_string(request, stop)
            output = self.output_processor.make_output(request)
            if output is not None and request.request_id in self.parent_of:
                output = self._parallel_output(output)
            if output is not None:
                outputs.append(output)
            if request.is_finished:
                self.output_processor.remove_request(request.request_id)
        return outputs

    def _parallel_output(self, output: RequestOutput) -> RequestOutput | None:
        """A child's output as its parent's (n > 1); the group is forgotten once all finish."""
        parent_id = self.parent_of[output.request_id] if not output.finished else self.parent_of.pop(output.request_id)
        group = self.parallel[parent_id]
        merged = group.add(output)
        if group.finished:
            del self.parallel[parent_id]
        return merged

    def _release_finished_if_idle(self) -> None:
        """Finished requests reach the worker with the next batch; with none coming, send them now
        (plugins free what they keep per request in ``request_finished``)."""
        if self.scheduler.finished_request_ids and not self.in_flight and not self.scheduler.has_unfinished():
            self.worker.execute(SchedulerOutput.empty(self.scheduler.finished_request_ids))
            self.scheduler.finished_request_ids = []
