"""Rotary position embeddings (NeoX / HF "rotate half" layout), with Llama-3, linear and YaRN scaling.

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


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched ``factor`` times: 0.1 ln(s) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_parameters(inv_freq: torch.Tensor, head_dim: int, base: float, max_position: int,
                    scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN ("NTK-by-parts", gpt-oss, DeepSeek, Qwen long-context): ``(inv_freq, attention_factor)``.

    Dimensions rotating more than ``beta_fast`` times over the original context keep their
    frequency (they never see an unseen angle), those rotating fewer than ``beta_slow`` times
    are slowed ``factor`` times (interpolated), and a linear ramp over the dimension index
    blends the band between. ``truncate`` (default True, as transformers 5 reads it) rounds the
    band's ends outwards to whole dimensions; gpt-oss sets it False. The attention factor
    multiplies cos and sin (so q.k by its square): ``attention_factor`` if given, else
    ``mscale / mscale_all_dim`` temperatures (DeepSeek), else ``0.1 ln(factor) + 1``.
    """
    original = scaling.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("yarn rope scaling needs original_max_position_embeddings")
    # No factor: the ratio of the extended context to the original (DeepSeek-V3's configs).
    factor = scaling.get("factor") or max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    # A zero or missing beta means the paper's defaults (transformers treats 0 the same way).
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        # The dimension index whose wavelength fits ``rotations`` times into the original context.
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # ramp 0 (fast dimensions): the original frequency; ramp 1 (slow ones): interpolated.
    return (inv_freq / factor) * ramp + inv_freq * (1 - ramp), float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None = None):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        attention_factor = 1.0
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "yarn":
            inv_freq, attention_factor = yarn_parameters(inv_freq, head_dim, base, max_position, scaling)
        elif rope_type != "default":
            raise ValueError(f"unsupported rope scaling type {rope_type!r}")
        self.attention_factor = attention_factor
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # Kept in fp32: rounding cos/sin to bf16 shifts long-context positions noticeably.
        # YaRN's temperature is folded into the table, so the kernels need not know of it.
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        if attention_factor != 1.0:
            cos_sin = cos_sin * attention_factor
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq*D] and k [T, Hkv*D] (row-strided views allowed) in place by their tokens' positions."""
        ops_for(q).apply_rotary(positions, q, k, self.cos_sin, self.head_dim)
        return q, k


def get_rope(head_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, max_position, base, scaling)
