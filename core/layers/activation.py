"""Activation of gated MLPs whose gate and up projections are fused into one matmul."""

from __future__ import annotations

import torch
from torch import nn

from hookllm.kernels import ops_for


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2 * d] laid out as (gate, up) -> silu(gate) * up, [..., d]; one Triton kernel on CUDA."""
        shape = gate_up.shape
        out = ops_for(gate_up).silu_and_mul(gate_up.reshape(-1, shape[-1]))
        return out.view(*shape[:-1], shape[-1] // 2)
