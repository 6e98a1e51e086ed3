"""What a pipeline stage builds in place of the parts other stages hold."""

from __future__ import annotations

from torch import nn


class StageMissing(nn.Module):
    """A layer (or embedding, norm, head) another pipeline stage holds: no parameters, and an
    error if called, so a stage can never run what it did not load."""

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("this layer belongs to another pipeline stage")


def on_other_stage(model: nn.Module, name: str) -> bool:
    """Whether checkpoint tensor ``name`` (``model.layers.7.mlp.down_proj.weight``) belongs to a
    part of ``model`` that is :class:`StageMissing` on this stage: its ``load_weights`` skips it."""
    module = model
    for part in name.split(".")[:-1]:
        module = module._modules.get(part) if isinstance(module, nn.Module) else None
        if module is None:
            return False
        if isinstance(module, StageMissing):
            return True
    return False
