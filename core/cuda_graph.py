"""CUDA graphs for decode-only steps: captured once per batch-size bucket, then replayed.

A decode step launches hundreds of small kernels whose launch cost exceeds their run time at
small batch; a replayed graph launches them all at once. Inputs live in static buffers that
each replay reads; a batch is padded up to its bucket (padding rows write no KV: slot -1).
Attention is captured with ``max_seq_len = max_model_len``, so one graph serves every context
length (the kernels read the real lengths from ``seq_lens``).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from hookllm.forward_context import AttentionMetadata, set_forward_context


def batch_size_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_batch_size``."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size] + list(range(16, max_batch_size + 1, 16))
    return sorted(set(sizes + [max_batch_size]))


class CudaGraphRunner:
    def __init__(self, model: nn.Module, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 max_batch_size: int, max_blocks_per_seq: int, max_model_len: int, backend: ModuleType):
        self.model = model
        self.max_model_len = max_model_len
        self.backend = backend
        self.buckets = batch_size_buckets(max_batch_size)
        n = max_batch_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.hidden_states = torch.empty(n, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture_all()

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs], seq_lens=self.seq_lens[:bs],
            query_start_loc=self.query_start_loc[: bs + 1], max_query_len=1, max_seq_len=self.max_model_len,
            backend=self.backend,
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for bs in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory pool
            with set_forward_context(self._metadata(bs)):
                self.model(self.input_ids[:bs], self.positions[:bs])  # warm-up: compile and autotune
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.hidden_states[:bs] = self.model(self.input_ids[:bs], self.positions[:bs])
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, num_seqs: int, max_query_len: int, num_blocks: int) -> bool:
        return max_query_len == 1 and num_seqs <= self.buckets[-1] and num_blocks <= self.block_tables.shape[1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Hidden states for a decode batch (one token per sequence), through the bucket's graph."""
        n = input_ids.shape[0]
        bs = next(b for b in self.buckets if b >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = slot_mapping
        self.slot_mapping[n:bs] = -1
        self.block_tables[:n, : block_tables.shape[1]] = block_tables
        self.seq_lens[:n] = seq_lens
        self.seq_lens[n:bs] = 1
        self.graphs[bs].replay()
        return self.hidden_states[:n]
