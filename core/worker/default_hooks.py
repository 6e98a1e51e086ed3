"""The core's own hook implementations, handed to the plugin manager by the worker side
(:func:`hookllm.worker.worker.resolve_model`) and registered ``trylast``, so any plugin
overrides them. They live here, not in the plugin framework, because they need the engine."""

from __future__ import annotations

import torch

from hookllm.config import ModelConfig
from hookllm.plugins.hookspecs import hookimpl
from hookllm.plugins.quantization import quantize_model
from hookllm.plugins.registry import ModelRegistry
from hookllm.worker import sampler
from hookllm.worker.batch import Batch
from hookllm.worker.model_loader import building_on, load_checkpoint


@hookimpl(trylast=True)
def load_model(model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
               registry: ModelRegistry) -> torch.nn.Module:
    """Build the registered class on the target device and dtype, give its layers the
    quantization method's parameters (if any), then load its safetensors (only this rank's
    slices of them under tensor parallelism) or dummy weights."""
    model_cls = registry.resolve(model_config.architecture, model_config.plugin)
    with building_on(device, dtype):
        model = model_cls(model_config.hf_config)
        if model_config.quantization is not None:
            quantize_model(model, model_config.quantization)
    load_checkpoint(model, model_config.path, model_config.load_format, model_config.quantization)
    return model.eval()


@hookimpl(trylast=True)
def sample(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    return sampler.sample(logits, batch.sampling_requests, batch.generator, batch.sampling_positions)
