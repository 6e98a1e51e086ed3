"""The per-step attention metadata (and an encoder's token types), set by the model runner
around each forward pass.

Models never receive it as an argument: the paged ``Attention`` layers read it from here, so a
model's ``forward(input_ids, positions, inputs_embeds)`` stays the same in every batch shape.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import ModuleType
from typing import Iterator, Sequence

import torch


@dataclass
class AttentionMetadata:
    """Where each scheduled token's K/V goes and which cache blocks each sequence reads.

    Both are per KV cache group (``hookllm.worker.kv_cache_groups``), indexed by each layer's
    ``Attention.kv_cache_group``: separate tensors, so a layer picks its own without a device op.
    """

    slot_mapping: Sequence[torch.Tensor]  # per group: [num_tokens] int64, flat cache slot of each new token
    block_tables: Sequence[torch.Tensor]  # per group: [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    backend: ModuleType  # provides store_kv and paged_attention
    # [num_tokens] long: each token's segment of a text pair (0, then 1 for the second text), set
    # for an encoder that reads token types when the step holds a pair; None otherwise.
    token_type_ids: torch.Tensor | None = None


_current: AttentionMetadata | None = None


def get_forward_context() -> AttentionMetadata:
    """The metadata of the forward pass in progress."""
    if _current is None:
        raise RuntimeError("paged attention ran outside the model runner's forward context")
    return _current


@contextlib.contextmanager
def set_forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    global _current
    previous, _current = _current, metadata
    try:
        yield
    finally:
        _current = previous
