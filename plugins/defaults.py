"""The core's own hook implementations, registered ``trylast`` so any plugin can override them."""

from __future__ import annotations

from hookllm import sampler
from hookllm.model_loader import building_on, iterate_weights
from hookllm.plugins.hookspecs import hookimpl


@hookimpl(trylast=True)
def load_model(model_config, device, dtype, registry):
    """Build the registered class on the target device and dtype, then load its safetensors."""
    model_cls = registry.resolve(model_config.architecture, model_config.plugin)
    with building_on(device, dtype):
        model = model_cls(model_config.hf_config)
    model.load_weights(iterate_weights(model_config.path))
    return model.eval()


@hookimpl(trylast=True)
def sample(logits, batch):
    return sampler.sample(logits, batch.sampling_requests, batch.generator)
