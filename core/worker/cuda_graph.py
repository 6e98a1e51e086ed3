"""CUDA graphs: captured once per bucket, then replayed.

A step launches hundreds of small kernels, and launching them one by one from Python costs
more than running them unless the step is large; a replayed graph launches them all at once.
Inputs live in static buffers that each replay reads.

- **Decode steps** (one token per sequence): one graph per batch-size bucket; a batch is padded
  up to its bucket (padding rows write no KV: slot -1).
- **Steps with prefill** (``max_mixed_tokens`` > 0): one graph per token-count bucket, every one
  with ``max_num_seqs`` sequences, and one per size in ``exact_token_buckets`` (under
  speculative decoding, verification steps of k + 1 tokens for each request of a decode
  bucket). Tokens are padded up to the bucket (slot -1, owned by no sequence: their rows are
  never attended to and never read back) and sequences up to ``max_num_seqs`` (no query
  tokens, no context: their attention programs return at once). Attention is captured for the
  longest query, so its grid depends only on the bucket's token and sequence counts, and the
  kernel reads the real layout from ``query_start_loc``.

Attention is captured with ``max_seq_len = max_model_len``, so one graph serves every context
length (the kernels read the real lengths from ``seq_lens``). The slot mapping and block tables
have one plane per KV cache group; each layer's kernels read its group's plane.

With LoRA (a ``lora_mapping``), every bucket has two graphs: one launching the adapters' kernels
(which read the step's token-to-slot mapping from the mapping's buffers) and one without them,
replayed by steps where no row has an adapter, so those cost what they cost without LoRA.
"""

from __future__ import annotations

from types import ModuleType
from typing import Iterable

import torch
from torch import nn

from hookllm.lora.layers import LoRAMapping
from hookllm.worker.forward_context import AttentionMetadata, set_forward_context


def batch_size_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_batch_size``."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size] + list(range(16, max_batch_size + 1, 16))
    return sorted(set(sizes + [max_batch_size]))


def speculating_buckets(max_batch_size: int, disable_by_batch_size: int | None) -> list[int]:
    """The decode batch buckets of steps that may speculate: all of them, or with
    ``disable_by_batch_size`` (no speculation above it) up to the one that holds that many."""
    buckets = batch_size_buckets(max_batch_size)
    if disable_by_batch_size is None or disable_by_batch_size >= buckets[-1]:
        return buckets
    return [b for b in buckets if b < disable_by_batch_size] + [next(b for b in buckets if b >= disable_by_batch_size)]


def token_buckets(max_tokens: int, exact: Iterable[int] = ()) -> list[int]:
    """16, 24, 32, 48, 64, ...: powers of two and the midpoints between them (at most half of a
    bucket is padding), and the sizes ``exact`` (steps of a shape known ahead), up to
    ``max_tokens``, which is the last; empty for 0."""
    sizes, size = list(exact), 16
    while size < max_tokens:
        sizes += [size, size * 3 // 2]
        size *= 2
    return sorted({s for s in sizes if s < max_tokens} | ({max_tokens} if max_tokens > 0 else set()))


class CudaGraphRunner:
    def __init__(self, model: nn.Module, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 max_batch_size: int, max_blocks_per_seq: int, max_model_len: int, backend: ModuleType,
                 max_mixed_tokens: int = 0, max_num_seqs: int = 0, num_kv_cache_groups: int = 1,
                 lora_mapping: LoRAMapping | None = None, pool: tuple | None = None,
                 exact_token_buckets: Iterable[int] = ()):
        self.model = model
        self.lora_mapping = lora_mapping
        self.max_model_len = max_model_len
        self.backend = backend
        self.buckets = batch_size_buckets(max_batch_size)
        self.mixed_buckets = token_buckets(max_mixed_tokens, exact_token_buckets)
        self.max_num_seqs = max_num_seqs
        tokens = max(max_batch_size, max_mixed_tokens)
        seqs = max(max_batch_size, max_num_seqs)
        self.input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=device)
        groups = num_kv_cache_groups
        self.slot_mapping = torch.full((groups, tokens), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(groups, seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(seqs, dtype=torch.int32, device=device)
        # A decode graph reads 0, 1, 2, ... and never has it written; a mixed one its own copy.
        self.decode_query_start_loc = torch.arange(max_batch_size + 1, dtype=torch.int32, device=device)
        self.mixed_query_start_loc = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=device)
        self.hidden_states = torch.empty(tokens, hidden_size, dtype=dtype, device=device)
        # Keyed by (bucket, whether the LoRA kernels run).
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.mixed_graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        # The graphs' memory pool: another runner's (``pool``) or this one's first graph's.
        self.pool = pool
        self._capture_all()

    def _decode_metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:, :bs].unbind(), block_tables=self.block_tables[:, :bs].unbind(),
            seq_lens=self.seq_lens[:bs],
            query_start_loc=self.decode_query_start_loc[: bs + 1], max_query_len=1, max_seq_len=self.max_model_len,
            backend=self.backend,
        )

    def _mixed_metadata(self, tokens: int) -> AttentionMetadata:
        seqs = self.max_num_seqs
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:, :tokens].unbind(), block_tables=self.block_tables[:, :seqs].unbind(),
            seq_lens=self.seq_lens[:seqs], query_start_loc=self.mixed_query_start_loc,
            max_query_len=self.max_model_len, max_seq_len=self.max_model_len, backend=self.backend,
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        # Largest first, so smaller graphs reuse its memory pool; the mixed graphs hold the
        # largest activations, so they go first.
        captures = ([(tokens, self._mixed_metadata(tokens), self.mixed_graphs) for tokens in reversed(self.mixed_buckets)]
                    + [(bs, self._decode_metadata(bs), self.graphs) for bs in reversed(self.buckets)])
        lora_modes = (True, False) if self.lora_mapping is not None else (False,)
        for n, metadata, graphs in captures:
            for with_lora in lora_modes:
                if self.lora_mapping is not None:
                    self.lora_mapping.active = with_lora
                with set_forward_context(metadata):
                    self.model(self.input_ids[:n], self.positions[:n])  # warm-up: compile and autotune
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool):
                        self.hidden_states[:n] = self.model(self.input_ids[:n], self.positions[:n])
                self.pool = graph.pool() if self.pool is None else self.pool
                graphs[n, with_lora] = graph
        torch.cuda.synchronize()

    def can_run(self, num_tokens: int, num_seqs: int, max_query_len: int, num_blocks: int) -> bool:
        """Whether a step of this shape has a graph (decode, or with prefill when captured)."""
        if num_blocks > self.block_tables.shape[2]:
            return False
        if max_query_len == 1:
            return num_seqs <= self.buckets[-1]
        return bool(self.mixed_buckets) and num_tokens <= self.mixed_buckets[-1] and num_seqs <= self.max_num_seqs

    def run_step(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 metadata: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states of a step given by its attention metadata, through a graph; None where
        no graph has its shape."""
        block_tables = metadata.block_tables
        if not self.can_run(input_ids.shape[0], metadata.seq_lens.shape[0], metadata.max_query_len,
                            block_tables[0].shape[1]):
            return None
        return self.run(input_ids, positions, torch.stack(tuple(metadata.slot_mapping)),
                        torch.stack(tuple(block_tables)), metadata.seq_lens, metadata.query_start_loc,
                        metadata.max_query_len)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
            max_query_len: int) -> torch.Tensor:
        """Hidden states of the step's tokens, through its bucket's graph (``can_run`` said yes);
        ``slot_mapping`` and ``block_tables`` have a leading KV cache group dimension."""
        n, seqs = input_ids.shape[0], seq_lens.shape[0]
        decode = max_query_len == 1
        with_lora = self.lora_mapping is not None and self.lora_mapping.active
        padded = next(b for b in (self.buckets if decode else self.mixed_buckets) if b >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:, :n] = slot_mapping
        self.slot_mapping[:, n:padded] = -1
        self.block_tables[:, :seqs, : block_tables.shape[2]] = block_tables
        self.seq_lens[:seqs] = seq_lens
        if decode:
            self.seq_lens[n:padded] = 1
            self.graphs[padded, with_lora].replay()
        else:
            self.seq_lens[seqs:self.max_num_seqs] = 0
            self.mixed_query_start_loc[: seqs + 1] = query_start_loc
            self.mixed_query_start_loc[seqs + 1:] = n
            self.mixed_graphs[padded, with_lora].replay()
        return self.hidden_states[:n]
