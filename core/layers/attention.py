"""The paged attention layer every adapter uses.

The layer holds one layer's K and V cache and its KV cache group (both bound by the worker: the
cache tensors may be shared with the layers of other groups) and delegates to the backend named
in the forward context: the pure-torch reference or Triton.
"""

from __future__ import annotations

import torch
from torch import nn

from hookllm.worker.forward_context import get_forward_context


class Attention(nn.Module):
    """Causal GQA attention over the paged cache, with this layer's variants: a sliding window of
    ``sliding_window`` tokens (itself included), Gemma 2's logit soft-capping ``softcap``, and
    bidirectional attention (``causal=False``, an encoder's: a prompt must then be computed in
    one step). :func:`hookllm.kernels.reference.paged_attention` gives the exact semantics."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int | None = None, *,
                 sliding_window: int | None = None, softcap: float | None = None, causal: bool = True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        if softcap is not None and softcap <= 0:
            raise ValueError(f"softcap must be positive, got {softcap}")
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.causal = causal
        # [num_blocks, block_size, num_kv_heads, head_dim] each; empty until the worker binds them.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # Whose block tables and slot mapping it reads (hookllm.worker.kv_cache_groups).
        self.kv_cache_group = 0
        # An FP8 cache holds K / k_scale and V / v_scale: the checkpoint's scales, else 1.0
        # (set at load by the quantization method; python floats, so no step reads a tensor).
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, num_heads * head_dim]; k, v: [T, num_kv_heads * head_dim] -> [T, num_heads * head_dim].

        ``sinks``: this layer's attention-sink logits ``[num_heads]`` (gpt-oss), owned by the model."""
        ctx = get_forward_context()
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        group = self.kv_cache_group
        ctx.backend.store_kv(k, v, self.k_cache, self.v_cache, ctx.slot_mapping[group], self.k_scale, self.v_scale)
        out = ctx.backend.paged_attention(
            q, self.k_cache, self.v_cache, ctx.block_tables[group], ctx.seq_lens, ctx.query_start_loc,
            ctx.max_query_len, ctx.max_seq_len, self.scale,
            sliding_window=self.sliding_window, softcap=self.softcap, sinks=sinks,
            k_scale=self.k_scale, v_scale=self.v_scale, causal=self.causal,
        )
        return out.view(num_tokens, self.num_heads * self.head_dim)
