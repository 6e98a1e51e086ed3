"""The worker: one device, the model on it, its paged KV cache and the model runner.

Everything it needs comes from the ``EngineConfig`` (plugins by name included), and each step
from a plain ``SchedulerOutput``, so a worker can be rebuilt in another process
(``Worker.from_config``) and driven by pickled snapshots alone.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any, Callable

import torch
from torch import nn

from hookllm.config import EngineConfig, ModelConfig, resolve_device, resolve_dtype, text_config_of
from hookllm.worker.cuda_graph import CudaGraphRunner, speculating_buckets
from hookllm.distributed import (
    check_pipeline_parallel, check_tensor_parallel, is_first_stage, is_last_stage, set_expert_parallel,
)
from hookllm.worker.forward_context import AttentionMetadata, set_forward_context
from hookllm.kernels import get_attention_backend, resolve_attention_backend
from hookllm.kernels.reference import FP8_DTYPE
from hookllm.layers.attention import Attention
from hookllm.lora.layers import lora_kernels
from hookllm.lora.manager import LoRAManager
from hookllm.worker import default_hooks
from hookllm.worker.kv_cache_groups import group_layers
from hookllm.worker.input_batch import InputBatch
from hookllm.worker.pooler import Pooler
from hookllm.worker.model_runner import ModelRunner, StepOutput
from hookllm.worker.pipeline_stage import PipelineStage
from hookllm.plugins.components import ComponentKind
from hookllm.spec.guess_graphs import GuessGraphs
from hookllm.spec.proposer import ModelProposer, Proposer
from hookllm.spec.verify import SpecDecoder
from hookllm.pooling_params import POOLING_TYPES
from hookllm.plugins.context import EngineContext
from hookllm.plugins.contract import capability
from hookllm.plugins.manager import ActiveHooks, PluginManager
from hookllm.plugins.quantization import quantized_by, resolve_quantization
from hookllm.plugins.registry import ModelRegistry
from hookllm.sched.output import SchedulerOutput
from hookllm.worker.warmup import warm_up

logger = logging.getLogger(__name__)


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """A cache tensor's bytes, for block copies: index kernels have no float8 variants."""
    return cache.view(torch.uint8)


def resolve_model(config: EngineConfig, plugin_manager: PluginManager) -> tuple[ModelConfig, ActiveHooks]:
    """The checkpoint's config and the active hooks, with this engine's context: the selected
    plugins, the plugin that serves the checkpoint's architecture (as ``config.model_impl``
    picks: a native registration, else a fallback such as the transformers backend), and the
    core defaults."""
    selected = plugin_manager.check_selected(config.plugins)
    device = resolve_device(config.device)
    model_config = ModelConfig.from_path(config.model, resolve_dtype(config.dtype, device), config.max_model_len,
                                         config.runner)
    registry = plugin_manager.registry
    owner = registry.owner(model_config.architecture, selected, config.model_impl)
    model_config.plugin = owner
    if config.pooler is not None:
        if model_config.pooler is None:
            raise ValueError(f"--pooler {config.pooler}: {config.model} runs the generate runner (--runner pooling)")
        model_config.pooler.pooling_type = config.pooler
        if config.pooler not in POOLING_TYPES:
            model_config.pooler.custom = plugin_manager.component(ComponentKind.POOLER, config.pooler)
    model_config.load_format = config.load_format
    model_cls = registry.resolve(model_config.architecture, owner)
    if capability(model_cls, "is_speculative_head"):
        raise ValueError(f"{config.model} is a speculative decoding head ({model_config.architecture}), not a model to "
                         "serve: serve its target with speculative_config {\"method\": \"eagle3\", \"model\": ...}")
    num_gpus = torch.cuda.device_count() if device.type == "cuda" else None
    if config.tensor_parallel_size > 1:
        check_tensor_parallel(model_cls, model_config.hf_config, config.tensor_parallel_size, num_gpus)
    check_pipeline_parallel(model_cls, model_config.hf_config, config.pipeline_parallel_size, config.world_size, num_gpus)
    model_config.quantization = resolve_quantization(
        model_config, config.quantization, lambda name: plugin_manager.component(ComponentKind.QUANTIZATION_METHOD, name))
    if model_config.quantization is not None and not capability(model_cls, "supports_quantization"):
        raise ValueError(f"quantization {model_config.quantization.name!r}: {model_config.architecture} served by "
                         f"{owner!r} has no quantizable layers (the native adapters' linear and MoE layers are)")
    if config.enable_expert_parallel and not capability(model_cls, "supports_expert_parallel"):
        raise ValueError(f"enable_expert_parallel: {model_config.architecture} served by {owner!r} has no "
                         "expert-parallel MoE layers (the native MoE adapters do)")
    if config.speculative_config is not None:
        if model_config.runner == "pooling":
            raise ValueError("speculative_config: the pooling runner samples no tokens to speculate on")
        model_config.spec_proposer = plugin_manager.component(ComponentKind.SPEC_PROPOSER,
                                                              config.speculative_config.method)
        if issubclass(model_config.spec_proposer, ModelProposer):
            model_config.spec_draft = draft_model_config(config, model_config, registry, selected,
                                                         model_config.spec_proposer)
    active = selected + ([owner] if owner not in selected else [])
    context = EngineContext(config, model_config, registry)
    return model_config, plugin_manager.active_hooks(active, default_hooks, context)


def draft_model_config(config: EngineConfig, target: ModelConfig, registry: ModelRegistry, selected: list[str],
                       proposer: type[ModelProposer]) -> ModelConfig:
    """The checkpoint of a model proposer (``speculative_config``'s ``model``), checked against
    the target's: the same vocabulary (token ids mean the same), positions for its length."""
    speculative = config.speculative_config
    if not speculative.model:
        raise ValueError(f"speculative_config: method {speculative.method!r} needs a model (its checkpoint's folder)")
    if config.tensor_parallel_size > 1 and speculative.draft_tensor_parallel_size == 1:
        raise ValueError("speculative_config: a draft model is sharded as the target is (tensor_parallel_size "
                         f"{config.tensor_parallel_size}); leave draft_tensor_parallel_size unset")
    head = proposer.head_of_target
    try:
        draft = ModelConfig.from_path(speculative.model, target.dtype, None if head else target.max_model_len,
                                      "generate")
    except ValueError as error:
        raise ValueError(f"speculative_config's model {speculative.model}: {error}") from None
    if head:  # it takes the target's positions (its rotary table must reach them)
        text = text_config_of(draft.hf_config)
        text.max_position_embeddings = max(getattr(text, "max_position_embeddings", 0) or 0, target.max_model_len)
        draft.max_model_len = target.max_model_len
    draft_vocab = text_config_of(draft.hf_config).vocab_size
    target_vocab = text_config_of(target.hf_config).vocab_size
    if draft_vocab != target_vocab:
        raise ValueError(f"speculative_config's model {speculative.model} has a vocabulary of {draft_vocab} tokens, "
                         f"the target's {target_vocab}: a draft model needs the target's tokenizer")
    draft.plugin = registry.owner(draft.architecture, selected)  # model_impl picks the target's
    draft.load_format = config.load_format
    return draft


class Worker:
    """The model, its KV cache and its runner in this process: the engine's executor
    (``hookllm.worker.executor.Executor``) unless the model runs in rank processes."""

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Worker":
        """A worker built from the config alone (plugins found again by name), e.g. in another process."""
        plugin_manager = PluginManager()
        model_config, hooks = resolve_model(config, plugin_manager)
        return cls(config, model_config, hooks)

    def __init__(self, config: EngineConfig, model_config: ModelConfig, hooks: ActiveHooks):
        self.config = config
        self.model_config = model_config
        set_expert_parallel(config.enable_expert_parallel)  # read by MoE layers as they are built
        self.device = resolve_device(config.device)
        self.dtype = model_config.dtype
        self.hooks = hooks
        backend = resolve_attention_backend(config.attention_backend, self.device)
        self.attention_backend = get_attention_backend(backend)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # Pipeline stages run eagerly: their graphs would need the received hidden states as inputs.
        self.uses_cuda_graphs = (self.device.type == "cuda" and backend == "triton" and not config.enforce_eager
                                 and config.pipeline_parallel_size == 1)
        # Seconds of each start-up phase, in order (logged; benchmarks/startup.py reports them).
        self.startup_seconds: dict[str, float] = {}
        phase = self._phase_timer()
        model = hooks.hook.load_model(device=self.device, dtype=self.dtype, context=hooks.context)
        if not isinstance(model, nn.Module):
            raise TypeError(f"{hooks.overriding_plugins('load_model')}: load_model must return "
                            f"a torch.nn.Module, got {type(model).__name__}")
        if quantized_by(model) is not model_config.quantization:
            raise ValueError(f"{hooks.overriding_plugins('load_model')}: load_model returned a model not built "
                             f"for quantization {model_config.quantization.name!r} (see quantize_model)")
        self.model = model
        # LoRA: the projections take adapter slots before anything measures memory or captures graphs.
        self.lora = (LoRAManager(model, model_config.hf_config, config.max_loras, config.max_lora_rank,
                                 config.max_cpu_loras, max(config.max_num_batched_tokens, config.max_num_seqs),
                                 self.device, self.dtype, lora_kernels(backend))
                     if config.enable_lora else None)
        # With LoRA the decoder stays eager inside the graphs: the adapters' layers choose kernels and
        # switch streams in Python, which torch.compile would break its graph on at every projection.
        if (self.uses_cuda_graphs and config.torch_compile and capability(model, "supports_torch_compile")
                and self.lora is None):
            model.use_torch_compile()  # compiled by the CUDA-graph warm-up below, before any request
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        if not self.attention_layers:
            raise ValueError(f"{type(model).__name__} has no hookllm.layers.Attention layer to hold a KV cache")
        # A model proposer's own model: its layers keep their K/V in the same blocks as the target's.
        self.draft_model = self._load_draft_model() if model_config.spec_draft is not None else None
        if self.draft_model is not None:
            self.attention_layers += [m for m in self.draft_model.modules() if isinstance(m, Attention)]
        # Made before memory is measured and graphs captured: a model proposer may ask the target for more.
        proposer = self._make_proposer() if config.speculative_config is not None else None
        # The block tables follow the layers' own windows: a group's freed blocks are blocks its layers never read.
        self.kv_cache_groups = group_layers([layer.sliding_window for layer in self.attention_layers],
                                            [(layer.num_kv_heads, layer.head_dim) for layer in self.attention_layers],
                                            model_config.max_model_len)
        for group, layers in enumerate(self.kv_cache_groups.layers):
            for index in layers:
                self.attention_layers[index].kv_cache_group = group
        self.kv_cache_dtype = FP8_DTYPE if config.kv_cache_dtype.startswith("fp8") else self.dtype
        if self.kv_cache_dtype != FP8_DTYPE:
            # A checkpoint's KV scales are for an FP8 cache; this one holds K and V as computed.
            for layer in self.attention_layers:
                layer.k_scale = layer.v_scale = 1.0
        phase("load_model")
        self.num_kv_blocks = config.num_kv_blocks or self._blocks_from_memory()
        self._allocate_kv_cache(self.num_kv_blocks)
        phase("memory_profile_and_kv_cache")
        # Swap space: the host's K/V cache for swapped-out requests, laid out as the device's.
        self.num_host_blocks = (int(config.swap_space * 2**30) // self.block_bytes
                                if config.preemption_mode == "swap" else 0)
        self._allocate_host_cache(self.num_host_blocks)
        phase("host_swap_cache")
        pooler = Pooler.for_model(model_config, self.device, model) if model_config.pooler is not None else None
        self.runner = ModelRunner(model, hooks, self.device, config.block_size, self.attention_backend, config.seed,
                                  InputBatch(self.kv_cache_groups.num_groups, self.device, config.max_num_seqs,
                                             -(-model_config.max_model_len // config.block_size),
                                             keeps_token_ids=config.speculative_config is not None), pooler)
        self.runner.lora = self.lora
        if proposer is not None:
            self.runner.spec = SpecDecoder(config.speculative_config, proposer, hooks.drafted_extra_args)
        if config.pipeline_parallel_size > 1:
            self.runner.stage = PipelineStage(capability(model, "pipeline_intermediate_count"),
                                              text_config_of(model_config.hf_config).hidden_size, self.dtype, self.device)
        if self.uses_cuda_graphs:
            max_graph_batch = min(config.max_num_seqs, config.max_cuda_graph_batch_size)
            speculative = config.speculative_config
            speculating = ([] if speculative is None
                           else speculating_buckets(max_graph_batch, speculative.disable_by_batch_size))
            k = speculative.num_speculative_tokens if speculative is not None else 0
            self.runner.cuda_graphs = CudaGraphRunner(
                model, text_config_of(model_config.hf_config).hidden_size, self.dtype, self.device,
                max_batch_size=max_graph_batch,
                max_blocks_per_seq=-(-model_config.max_model_len // config.block_size),
                max_model_len=model_config.max_model_len, backend=self.attention_backend,
                max_mixed_tokens=min(config.max_cuda_graph_tokens, config.max_num_batched_tokens),
                max_num_seqs=config.max_num_seqs, num_kv_cache_groups=self.kv_cache_groups.num_groups,
                lora_mapping=self.lora.mapping if self.lora is not None else None,
                exact_token_buckets=[(k + 1) * b for b in speculating],
            )
            if isinstance(proposer, ModelProposer):
                self._capture_proposer_graphs(proposer, self.runner.cuda_graphs, speculating)
            phase("cuda_graphs")
        # Compiling on first use would land in the first requests' latency (hookllm.worker.warmup).
        if config.warmup and self.device.type == "cuda" and self.runner.stage is None:
            warm_up(self)
            phase("warmup")
        # The engine's start-up summary reports these (hookllm.engine.llm_engine); under tensor
        # parallelism every rank has its own.
        logger.debug("start-up: %s", ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.startup_seconds.items()))

    def _capture_proposer_graphs(self, proposer: ModelProposer, target: CudaGraphRunner,
                                 batch_buckets: list[int]) -> None:
        """A model proposer's graphs, in the target's graph memory pool: its guessing steps (for
        ``batch_buckets``) and, where it has a ``step_model``, its passes over the steps' tokens."""
        config = self.config
        step_model = proposer.step_model()
        if step_model is not None:
            proposer.step_graphs = CudaGraphRunner(
                step_model, text_config_of(self.model_config.spec_draft.hf_config).hidden_size, self.dtype,
                self.device, max_batch_size=target.buckets[-1], max_blocks_per_seq=target.block_tables.shape[2],
                max_model_len=target.max_model_len, backend=self.attention_backend,
                max_mixed_tokens=target.mixed_buckets[-1] if target.mixed_buckets else 0,
                max_num_seqs=config.max_num_seqs, num_kv_cache_groups=self.kv_cache_groups.num_groups,
                pool=target.pool, exact_token_buckets=target.mixed_buckets)
        proposer.guess_graphs = GuessGraphs(proposer, config.speculative_config.num_speculative_tokens, target,
                                            batch_buckets)

    def _make_proposer(self) -> Proposer:
        """``speculative_config``'s proposer: ``cls(config, context)``, a model proposer's with its
        model and the target's (:class:`hookllm.spec.proposer.ModelProposer`)."""
        cls, speculative, context = self.model_config.spec_proposer, self.config.speculative_config, self.hooks.context
        if self.draft_model is None:
            return cls(speculative, context)
        return cls(speculative, context, self.draft_model, self.model)

    def _load_draft_model(self) -> nn.Module:
        """The model proposer's checkpoint, loaded by the ``load_model`` hook as the target is."""
        context = EngineContext(self.config, self.model_config.spec_draft, self.hooks.context.registry)
        draft = self.hooks.hook.load_model(device=self.device, dtype=self.dtype, context=context)
        if not any(isinstance(m, Attention) for m in draft.modules()):
            raise ValueError(f"speculative_config's model: {type(draft).__name__} has no hookllm.layers.Attention "
                             "layer to keep its K/V in the engine's cache")
        return draft

    def _phase_timer(self) -> Callable[[str], None]:
        """A function that records the seconds since its last call (or since now) under a name,
        once the device's queued work is done."""
        last = [time.perf_counter()]

        def phase(name: str) -> None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            now = time.perf_counter()
            self.startup_seconds[name], last[0] = now - last[0], now

        return phase

    @property
    def quantization_summary(self) -> str:
        """The quantization method and the numeric path its layers run (its ``describe()``), or "none"."""
        method = self.model_config.quantization
        return method.describe() if method is not None else "none"

    @property
    def warmup_seconds(self) -> float | None:
        """Seconds the start-up warm-up took (None: it did not run)."""
        return self.startup_seconds.get("warmup")

    @property
    def slot_layers(self) -> list[Attention]:
        """One layer per cache slot (the first group's), whose shape the slot's tensors take."""
        return [self.attention_layers[index] for index in self.kv_cache_groups.layers[0]]

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block summed over the cache slots (K and V): one group's layers."""
        per_token = sum(2 * a.num_kv_heads * a.head_dim for a in self.slot_layers)
        return per_token * self.config.block_size * self.kv_cache_dtype.itemsize

    def _blocks_from_memory(self) -> int:
        """CPU: ``cpu_kv_cache_bytes``. CUDA: this engine may use ``gpu_memory_utilization`` of
        the device in all (weights + peak activations + KV cache), within what is free now."""
        if self.device.type != "cuda":
            return max(1, self.config.cpu_kv_cache_bytes // self.block_bytes)
        models = [self.model] + ([self.draft_model] if self.draft_model is not None else [])
        weight_bytes = sum(t.numel() * t.element_size() for model in models for t in model.state_dict().values())
        activation_bytes = self._profile_activation_bytes()
        if self.uses_cuda_graphs and self.config.max_cuda_graph_tokens:
            # The graphs of steps with prefill keep a memory pool about that large for good;
            # steps run eagerly (image embeddings, more tokens than captured) need their own.
            activation_bytes *= 2
        free, total = torch.cuda.mem_get_info(self.device)
        budget = min(total * self.config.gpu_memory_utilization - weight_bytes - activation_bytes,
                     free - activation_bytes)
        if budget < self.block_bytes:
            raise ValueError(
                f"no GPU memory left for the KV cache: weights {weight_bytes / 2**30:.1f} GiB, activations "
                f"{activation_bytes / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free of {total / 2**30:.1f}, "
                f"gpu_memory_utilization={self.config.gpu_memory_utilization}"
            )
        return int(budget // self.block_bytes)

    def _profile_activation_bytes(self) -> int:
        """Peak extra memory of a forward pass at the largest batch (max_num_batched_tokens)."""
        num_tokens = min(self.config.max_num_batched_tokens, self.model_config.max_model_len * self.config.max_num_seqs)
        block_size = self.config.block_size
        num_blocks = -(-num_tokens // block_size)
        self._allocate_kv_cache(num_blocks)
        # One long sequence covering the batch: the same activation shapes as any mix of that size.
        # Every group writes and reads the same blocks: only the shapes matter.
        groups = self.kv_cache_groups.num_groups
        metadata = AttentionMetadata(
            slot_mapping=(torch.arange(num_tokens, device=self.device),) * groups,
            block_tables=(torch.arange(num_blocks, dtype=torch.int32, device=self.device)[None],) * groups,
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            max_query_len=num_tokens, max_seq_len=num_tokens, backend=self.attention_backend,
        )
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        with torch.inference_mode(), set_forward_context(metadata):
            ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
            positions = torch.arange(num_tokens, device=self.device) % self.model_config.max_model_len
            stage = {}
            if self.config.pipeline_parallel_size > 1:  # a later stage's input: the previous one's output
                hidden_size = text_config_of(self.model_config.hf_config).hidden_size
                stage["intermediate_tensors"] = (None if is_first_stage() else
                                                 torch.zeros(2, num_tokens, hidden_size, dtype=self.dtype, device=self.device))
            hidden = self.model(ids, positions, **stage)
            if is_last_stage() and self.model_config.runner == "generate":  # the pooling runner has no logits
                self.model.compute_logits(hidden[-min(num_tokens, self.config.max_num_seqs):])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self._allocate_kv_cache(0)
        torch.cuda.empty_cache()
        return peak

    def _cache_tensors(self, num_blocks: int, **placement: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One K and one V tensor per cache slot, [num_blocks, block_size, num_kv_heads, head_dim]."""
        return [tuple(torch.empty((num_blocks, self.config.block_size, layer.num_kv_heads, layer.head_dim),
                                  dtype=self.kv_cache_dtype, **placement) for _ in range(2))
                for layer in self.slot_layers]

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        """The device cache, K and V per slot; the i-th layer of every group is bound to slot i
        (one group: a slot per layer), so block b of any group is row b of its layers' tensors."""
        self.kv_caches = self._cache_tensors(num_blocks, device=self.device)
        for layers in self.kv_cache_groups.layers:
            for (k_cache, v_cache), index in zip(self.kv_caches, layers):
                self.attention_layers[index].k_cache = k_cache
                self.attention_layers[index].v_cache = v_cache

    def _allocate_host_cache(self, num_blocks: int) -> None:
        """The host cache's slots, like the device cache; pinned on CUDA, so the copies in and
        out run at full speed."""
        self.host_caches = self._cache_tensors(num_blocks, pin_memory=self.device.type == "cuda" and num_blocks > 0)

    def execute(self, scheduler_output: SchedulerOutput, previous: StepOutput | None = None) -> StepOutput | None:
        # Swap-out first: the device blocks it frees may be written this step (new tokens, a copy).
        if scheduler_output.swap_out:
            self.swap_out(scheduler_output.swap_out)
        if scheduler_output.swap_in:
            self.swap_in(scheduler_output.swap_in)
        if scheduler_output.block_copies:
            self.copy_blocks(scheduler_output.block_copies)
        return self.runner.execute(scheduler_output, previous)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: each (source, destination) block's K and V, in every cache slot, one
        batched index copy per tensor (queued on the device before the step that writes them)."""
        pairs = torch.tensor(copies, dtype=torch.long).to(self.device, non_blocking=True)
        for slot in self.kv_caches:
            for cache in map(_bytes, slot):
                cache.index_copy_(0, pairs[:, 1], cache.index_select(0, pairs[:, 0]))

    @torch.inference_mode()
    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Each (device, host) block's K and V, in every cache slot, to host memory: one batched
        index copy per tensor. The device→host copy waits for the device's stream, so it reads
        the blocks after the step still in flight (async scheduling) has written them."""
        device_ids, host_ids = torch.tensor(pairs, dtype=torch.long).T
        device_ids = device_ids.to(self.device)
        for slot, host in zip(self.kv_caches, self.host_caches):
            for cache, host_cache in zip(map(_bytes, slot), map(_bytes, host)):
                host_cache.index_copy_(0, host_ids, cache.index_select(0, device_ids).cpu())

    @torch.inference_mode()
    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Each (host, device) block's K and V, in every cache slot, back to the device: one
        batched index copy per tensor, queued before the step that reads them."""
        host_ids, device_ids = torch.tensor(pairs, dtype=torch.long).T
        device_ids = device_ids.to(self.device)
        for slot, host in zip(self.kv_caches, self.host_caches):
            for cache, host_cache in zip(map(_bytes, slot), map(_bytes, host)):
                cache.index_copy_(0, device_ids, host_cache.index_select(0, host_ids).to(self.device))

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call ``method`` (a name of this worker's, or a function taking it first): one result."""
        call = getattr(self, method) if isinstance(method, str) else partial(method, self)
        return [call(*args, **(kwargs or {}))]

    def shutdown(self) -> None:
        """Release the KV cache and the swap space (the model goes with the last reference to the worker)."""
        self.runner.shutdown()
        self._allocate_kv_cache(0)
        self._allocate_host_cache(0)
