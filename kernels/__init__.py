"""GPU kernels (Triton) and their pure-torch references.

``get_attention_backend(name)`` returns a module-like object with ``store_kv`` and
``paged_attention``: ``"torch"`` is :mod:`hookllm.kernels.reference`, ``"triton"`` the Triton
kernels, and ``"auto"`` picks Triton on CUDA and torch elsewhere. ``ops_for(tensor)`` returns
the module with ``rms_norm``, ``apply_rotary``, ``silu_and_mul``, ``filter_thresholds``,
``sample_with_hashed_noise``, ``token_logprobs``, ``apply_token_bitmask``, ``apply_penalties``, the FP8
``quantize_fp8`` / ``scaled_matmul`` and the multi-LoRA ``lora_shrink`` / ``lora_expand``
(:mod:`hookllm.kernels.triton_lora`) for that tensor's device: the Triton kernels on CUDA, their torch
references elsewhere. :mod:`hookllm.kernels.triton_moe` holds the mixture-of-experts kernels
(``fused_moe``; its ``route`` and ``moe_align`` are the reference's, torch on every device), twins
of the reference's functions of those names.
:mod:`hookllm.kernels.triton_all_reduce` holds the one-shot all-reduce (twin of the reference's
``one_shot_all_reduce``). ``compiled_triton_variants()`` counts the Triton kernel variants compiled so far, ``triton_variant_keys()`` names them.
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


def ops_for(tensor: torch.Tensor) -> ModuleType:
    """:mod:`hookllm.kernels.triton_ops` for a CUDA tensor, :mod:`hookllm.kernels.reference` otherwise,
    and also while torch.compile traces: inductor then makes its own kernel of the reference's
    torch ops and fuses it with its neighbours (a residual add into the norm after it)."""
    if tensor.is_cuda and not torch.compiler.is_compiling():
        from hookllm.kernels import triton_ops

        return triton_ops
    from hookllm.kernels import reference

    return reference


def compiled_triton_variants() -> int:
    """How many variants of hookllm's Triton kernels this process has compiled (or loaded from
    Triton's cache), on every device. A diagnostic: after the start-up warm-up, serving should
    add none. 0 under the Triton interpreter, which compiles nothing."""
    return len(triton_variant_keys())


def triton_variant_keys() -> set[tuple[str, str]]:
    """Each compiled variant as (kernel name, Triton's specialization key): what a launch met
    that the variants before it did not (dtypes, pointer alignments, integer values of 1 or
    multiples of 16, constexprs)."""
    from triton.runtime.jit import JITFunction

    from hookllm.kernels import triton_all_reduce, triton_attention, triton_fp8, triton_lora, triton_moe, triton_ops

    kernels = [fn for module in (triton_attention, triton_ops, triton_moe, triton_fp8, triton_all_reduce, triton_lora)
               for fn in vars(module).values()
               if isinstance(fn, JITFunction)]
    # device_caches: per device, (kernel cache by specialization key, ...).
    return {(fn.__name__, str(key)) for fn in kernels for caches in fn.device_caches.values() for key in caches[0]}
