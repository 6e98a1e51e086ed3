"""The core's own hook implementations, registered ``trylast`` so any plugin can override them."""

from __future__ import annotations

from hookllm.worker import sampler
from hookllm.worker.model_loader import building_on, load_checkpoint
from hookllm.plugins.hookspecs import hookimpl


@hookimpl(trylast=True)
def load_model(model_config, device, dtype, registry):
    """Build the registered class on the target device and dtype, then load its safetensors
    (only this rank's slices of them under tensor parallelism) or dummy weights."""
    model_cls = registry.resolve(model_config.architecture, model_config.plugin)
    with building_on(device, dtype):
        model = model_cls(model_config.hf_config)
    load_checkpoint(model, model_config.path, model_config.load_format)
    return model.eval()


@hookimpl(trylast=True)
def sample(logits, batch):
    return sampler.sample(logits, batch.sampling_requests, batch.generator, batch.sampling_positions)
