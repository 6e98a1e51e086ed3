"""GPU kernels (Triton) and their pure-torch references.

``get_attention_backend(name)`` returns a module-like object with ``store_kv`` and
``paged_attention``: ``"torch"`` is :mod:`hookllm.kernels.reference`, ``"triton"`` the Triton
kernels, and ``"auto"`` picks Triton on CUDA and torch elsewhere. ``sample_with_noise`` runs
the sampler's last pass with the Triton kernel on CUDA and its reference elsewhere.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

ATTENTION_BACKENDS = ("auto", "torch", "triton")


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """The concrete backend ("torch" or "triton") for a requested name on a device."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention_backend='triton' on the CPU needs TRITON_INTERPRET=1 (the Triton interpreter)"
        )
    return name


def get_attention_backend(name: str) -> ModuleType:
    """The module implementing ``store_kv`` and ``paged_attention`` for a concrete backend."""
    if name == "triton":
        from hookllm.kernels import triton_attention

        return triton_attention
    from hookllm.kernels import reference

    return reference


def sample_with_noise(logits: torch.Tensor, temperature: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """See :func:`hookllm.kernels.reference.sample_with_noise`."""
    if logits.is_cuda:
        from hookllm.kernels import triton_sampling

        return triton_sampling.sample_with_noise(logits, temperature, noise)
    from hookllm.kernels import reference

    return reference.sample_with_noise(logits, temperature, noise)
