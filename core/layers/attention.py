"""The paged attention layer every adapter uses.

The layer owns one layer's K and V cache (bound by the worker once the cache is allocated) and
delegates to the backend named in the forward context: the pure-torch reference or Triton.
"""

from __future__ import annotations

import torch
from torch import nn

from hookllm.forward_context import get_forward_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        # [num_blocks, block_size, num_kv_heads, head_dim] each; empty until the worker binds them.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, num_heads * head_dim]; k, v: [T, num_kv_heads * head_dim] -> [T, num_heads * head_dim]."""
        ctx = get_forward_context()
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        ctx.backend.store_kv(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        out = ctx.backend.paged_attention(
            q, self.k_cache, self.v_cache, ctx.block_tables, ctx.seq_lens, ctx.query_start_loc,
            ctx.max_query_len, ctx.max_seq_len, self.scale,
        )
        return out.view(num_tokens, self.num_heads * self.head_dim)
