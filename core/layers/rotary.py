"""Rotary position embeddings (NeoX / HF "rotate half" layout), with Llama-3 and linear scaling.

The cos/sin table is computed once for every position up to ``max_position`` and indexed by the
flat ``positions`` tensor, so a mixed batch needs no per-sequence work.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from hookllm.kernels import ops_for


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by ``factor``, a smooth band between."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None = None):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type != "default":
            raise ValueError(f"unsupported rope scaling type {rope_type!r}")
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # Kept in fp32: rounding cos/sin to bf16 shifts long-context positions noticeably.
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq*D] and k [T, Hkv*D] (row-strided views allowed) in place by their tokens' positions."""
        ops_for(q).apply_rotary(positions, q, k, self.cos_sin, self.head_dim)
        return q, k


def get_rope(head_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, max_position, base, scaling)
