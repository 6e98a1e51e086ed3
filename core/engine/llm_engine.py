"""LLMEngine: requests in, one step at a time, ``RequestOutput``s out.

Three layers, one direction: the input processor turns a prompt and its parameters into engine
requests; the engine core schedules and runs them and returns each step's new tokens; the
output processor turns those into what users read and names the requests it stopped, which the
core then ends. No layer reads another's state.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Iterable

from hookllm.config import EngineConfig, ModelConfig, resolve_device
from hookllm.engine.core import EngineCore
from hookllm.engine.input_processor import InputProcessor
from hookllm.engine.output_processor import OutputProcessor
from hookllm.inputs import PromptType
from hookllm.lora.request import LoRARequest
from hookllm.outputs import RequestOutput
from hookllm.plugins.manager import PluginManager
from hookllm.sampling_params import SamplingParams
from hookllm.sched.scheduler import SchedulerStats
from hookllm.tokenizer import load_tokenizer
from hookllm.worker.worker import resolve_model

if TYPE_CHECKING:
    from hookllm.engine.arg_utils import EngineArgs

logger = logging.getLogger(__name__)


class LLMEngine:
    """Requests in, one step at a time, ``RequestOutput``s out (vLLM's offline engine).

    ``add_request`` runs the input processor and queues the result in the engine core; ``step``
    runs one core step and hands its outputs to the output processor.
    """

    def __init__(self, config: EngineConfig, plugin_manager: PluginManager | None = None):
        from hookllm.hub import with_local_paths

        started = time.perf_counter()
        # A hub id ("org/name") becomes its local snapshot folder before anything reads it.
        config = with_local_paths(config)
        self.config = config
        self.plugin_manager = plugin_manager or PluginManager()
        self.model_config, self.hooks = resolve_model(config, self.plugin_manager)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.hooks.context.tokenizer = self.tokenizer
        self.input_processor = InputProcessor(config, self.model_config, self.tokenizer, self.hooks)
        self.engine_core = EngineCore(config, self.model_config, self.hooks, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, self.hooks)
        logger.info("%s", startup_summary(self, time.perf_counter() - started))

    @classmethod
    def from_engine_args(cls, engine_args: "EngineArgs") -> "LLMEngine":
        """vLLM's constructor: an engine from :class:`hookllm.engine.arg_utils.EngineArgs`."""
        return cls(engine_args.create_engine_config())

    @property
    def active_plugins(self) -> list[str]:
        return self.hooks.plugin_names

    @property
    def eos_token_ids(self) -> set[int]:
        """The token ids that end a request unless ``ignore_eos`` is set."""
        return self.engine_core.eos_token_ids

    @property
    def max_logprobs(self) -> int:
        """The most logprobs a request may ask for: ``max_logprobs``, capped by the vocabulary."""
        return self.input_processor.max_logprobs

    def get_tokenizer(self) -> Any | None:
        """The checkpoint's tokenizer (None when the checkpoint has none)."""
        return self.tokenizer

    def get_model_config(self) -> ModelConfig:
        return self.model_config

    def get_num_unfinished_requests(self) -> int:
        """The user's requests queued or running (a request with ``n`` > 1 counts once)."""
        return len(self.output_processor.unfinished_request_ids())

    def unfinished_request_ids(self) -> list[str]:
        """The ids of the user's requests queued or running."""
        return self.output_processor.unfinished_request_ids()

    def shutdown(self) -> None:
        """Abort every request, stop the worker (its processes under tensor parallelism) and drop
        the model and KV cache; the engine cannot be used after, and a second call does nothing.
        ``hookllm.distributed.cleanup_dist_env_and_memory()`` then returns the memory."""
        if "engine_core" not in self.__dict__:
            return
        self.abort_request(self.unfinished_request_ids())
        self.engine_core.shutdown()
        for attr in ("engine_core", "input_processor", "output_processor"):
            self.__dict__.pop(attr, None)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """Tokenize, let plugins preprocess, check limits, and queue (vLLM's argument order),
        to run with ``lora_request``'s adapter if one is given (``enable_lora``).

        Bad input raises ``ValueError`` naming the request; nothing of it stays behind.
        """
        if self.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self.input_processor.process(request_id, prompt, params, lora_request)
        engine_requests = self.input_processor.fan_out(request)
        if len(engine_requests) > 1:
            taken = [r.request_id for r in engine_requests if self.has_request(r.request_id)]
            if taken:
                raise ValueError(f"request {request_id}: n={len(engine_requests)} needs the child ids {taken} "
                                 "that are in use")
        self.engine_core.add_requests(request_id, engine_requests)
        self.output_processor.add_request(request, engine_requests)
        return request_id

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` names an unfinished request."""
        return self.output_processor.has_request(request_id)

    def retain_blocks(self, request_id: str) -> None:
        """Keep the request's KV blocks once it finishes, for ``fork_request``, until ``release_request``."""
        self.engine_core.retain_blocks(request_id)

    def fork_request(self, parent_id: str, request_id: str, token_ids: list[int], params: SamplingParams) -> str:
        """Queue a request continuing the computed tokens of ``parent_id`` (a finished request whose
        blocks were retained) with ``token_ids``, sharing the parent's KV blocks (beam search)."""
        if self.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        child = self.engine_core.fork_request(parent_id, request_id, token_ids, params,
                                              self.model_config.max_model_len)
        self.output_processor.add_request(child, [child])
        return request_id

    def release_request(self, request_id: str) -> None:
        """Free the KV blocks a finished request kept for forks."""
        self.engine_core.release_request(request_id)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests now and free their KV blocks; unknown or finished ids are ignored."""
        request_ids = [request_id] if isinstance(request_id, str) else request_id
        self.engine_core.abort_requests(self.output_processor.abort_requests(request_ids))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while requests hold KV blocks."""
        return self.engine_core.reset_prefix_cache()

    def get_stats(self) -> SchedulerStats:
        """Running and waiting requests and KV-cache use now (for metrics)."""
        return self.engine_core.get_stats()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one engine-core step; return an output for every request that advanced.

        With async scheduling the outputs are those of the previous batch: its tokens are read
        back while the device runs this one, so host work overlaps the device's. If the step
        raises, every unfinished request has been aborted first (see above).
        """
        try:
            processed = self.output_processor.process_outputs(self.engine_core.step())
        except Exception:
            # A failed step (a plugin's hook raised, say) cannot tell which of its requests are
            # sound: it ends every request the engine holds (aborted, blocks freed), and the
            # engine serves new requests as before. The caller gets the exception.
            self.engine_core.drop_in_flight()
            self.abort_request(self.unfinished_request_ids())
            raise
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs


def startup_summary(engine: LLMEngine, seconds: float) -> str:
    """The start-up log's block: what ``engine`` serves and with what limits, one ``name: value``
    line each (the names are the settings' own where there is one)."""
    config, model_config, worker = engine.config, engine.model_config, engine.engine_core.executor
    phases = worker.startup_seconds
    graphs = phases.get("cuda_graphs")
    dtype = str(model_config.dtype).removeprefix("torch.")
    rows = {
        "model": config.model,
        "architecture": model_config.architecture,
        "plugin": model_config.plugin,  # the one whose class serves the architecture
        "dtype": dtype,
        "device": resolve_device(config.device),
        "kv_cache_blocks": worker.num_kv_blocks,
        "kv_cache_tokens": worker.num_kv_blocks * config.block_size,
        "block_size": config.block_size,
        "kv_cache_dtype": dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype,
        "max_model_len": model_config.max_model_len,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "tensor_parallel_size": config.tensor_parallel_size,
        "active_plugins": ", ".join(engine.active_plugins),
        "quantization": worker.quantization_summary,
        "cuda_graphs": "not used" if graphs is None else f"captured in {graphs:.2f} s",
        "load_time": f"{seconds:.2f} s (" + ", ".join(f"{name} {s:.2f} s" for name, s in phases.items()) + ")",
    }
    width = max(map(len, rows)) + 2
    return "engine ready\n" + "\n".join(f"  {name + ':':<{width}}{value}" for name, value in rows.items())
