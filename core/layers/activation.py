"""Activation of gated MLPs whose gate and up projections are fused into one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2 * d] laid out as (gate, up) -> silu(gate) * up, [..., d]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
