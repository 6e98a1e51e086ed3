"""The core's own hook implementations, handed to the plugin manager by the worker side
(:func:`hookllm.worker.worker.resolve_model`) and registered ``trylast``, so any plugin
overrides them. They live here, not in the plugin framework, because they need the engine."""

from __future__ import annotations

import torch

from hookllm.plugins.context import EngineContext
from hookllm.plugins.hookspecs import hookimpl
from hookllm.plugins.quantization import quantize_model
from hookllm.worker import sampler
from hookllm.worker.batch import Batch
from hookllm.worker.model_loader import building_on, construct_model, load_checkpoint


@hookimpl(trylast=True)
def load_model(device: torch.device, dtype: torch.dtype, context: EngineContext) -> torch.nn.Module:
    """Build the registered class on the target device and dtype (a multimodal one around its
    registered text decoder: ``construct_model``), give its layers the
    quantization method's parameters (if any), then load its safetensors (only this rank's
    slices of them under tensor parallelism) or dummy weights."""
    model_config, registry = context.model_config, context.registry
    model_cls = registry.resolve(model_config.architecture, model_config.plugin)
    with building_on(device, dtype):
        model = construct_model(model_cls, model_config.hf_config, registry, context.config.plugins)
        if model_config.quantization is not None:
            quantize_model(model, model_config.quantization)
    pooler = model_config.pooler
    load_checkpoint(model, model_config.path, model_config.load_format, model_config.quantization,
                    model_config.weight_prefix, pooler.checkpoint_tensors if pooler is not None else [])
    return model.eval()


@hookimpl(trylast=True)
def sample(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    return sampler.sample(logits, batch.sampling_requests, batch.generator, batch.sampling_positions,
                          batch.sampler_table)
