"""RMSNorm with the residual add fused into the same call (one read of the hidden states)."""

from __future__ import annotations

import torch
from torch import nn

from hookllm.distributed import custom_all_reduce_rms_norm, tensor_model_parallel_all_reduce
from hookllm.kernels import ops_for


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        # Set by a model whose row-parallel layer before this norm leaves its tensor-parallel sum
        # here (hookllm.adapters.llama.model.defer_reductions_to_norms): x is then this rank's
        # partial sum, reduced in the same kernel as the residual add and the norm.
        self.reduces_input = False

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual), ``x``
        first summed over the tensor-parallel ranks when this norm ``reduces_input``.

        Computed as transformers does (see ``hookllm.kernels.reference.rms_norm``); one Triton
        kernel on CUDA.
        """
        if residual is not None and self.reduces_input:
            fused = custom_all_reduce_rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
            x = tensor_model_parallel_all_reduce(x)  # too large for the one-shot kernel: NCCL's, then the norm
        shape = x.shape
        out = ops_for(x).rms_norm(x.reshape(-1, shape[-1]), self.weight, self.eps,
                                  None if residual is None else residual.reshape(-1, shape[-1]))
        if residual is None:
            return out.view(shape)
        return out[0].view(shape), out[1].view(shape)
