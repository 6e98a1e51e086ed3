"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks.

The vocabulary is padded up to a multiple of the rank count; rank r owns token ids
``[r * n, (r + 1) * n)`` (``n = padded_vocab / tp``), and the padding rows of the last rank
are zero and never looked up. The embedding and the head have the same layout, so a tied
head can share the embedding's weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hookllm.distributed import (
    get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce, tensor_model_parallel_gather,
)
from hookllm.layers.linear import LoadedWeight, check_loaded_shape, narrow_loaded


class VocabParallelEmbedding(nn.Module):
    """Each rank looks up the ids in its vocabulary range, writes zeros for the others, and
    one all-reduce assembles the full embeddings."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        out = F.embedding(torch.where(in_range, input_ids - self.vocab_start, 0), self.weight)
        out.masked_fill_(~in_range.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)

    def extra_repr(self) -> str:
        return (f"vocab={self.num_embeddings}, local ids [{self.vocab_start}, {self.vocab_end}), "
                f"dim={self.embedding_dim}, tp_rank={self.tp_rank}/{self.tp_size}")

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        check_loaded_shape(loaded, (self.num_embeddings, self.embedding_dim), type(self).__name__)
        num_real = max(0, self.vocab_end - self.vocab_start)
        param.data[:num_real].copy_(narrow_loaded(loaded, 0, self.vocab_start, num_real))
        param.data[num_real:].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """``logits = hidden @ W^T`` per vocabulary shard, all-gathered: every rank gets full
    ``[rows, vocab]`` logits (padding columns dropped), exactly as without parallelism."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden_states, self.weight)
        if self.tp_size == 1:
            return logits
        logits = tensor_model_parallel_gather(logits, dim=-1)
        if logits.shape[-1] == self.num_embeddings:
            return logits
        return logits[..., :self.num_embeddings].contiguous()
