"""Adapters on the token embedding and the LM head (PEFT's ``embed_tokens`` and ``lm_head``).

Their vocabulary-wide side makes the projections' kernels a poor fit (a one-hot input for the
embedding; rows that are the step's sampled rows, not its tokens, for the head), and each runs
once a step, not once a layer: both compute every slot's rank-R product for every row, keep each
row's own slot's columns (a mask from the row's slot) and multiply by all slots' B at once, two
matmuls whatever the mix of adapters. A and B stay whole on every tensor-parallel rank: the
delta is added to the base layer's full output (the embedding's all-reduced rows, the head's
gathered logits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from hookllm.lora.layers import LoRAMapping


def _own_slot(h: torch.Tensor, slots: torch.Tensor, rank: int) -> torch.Tensor:
    """``h`` ([rows, slots * rank]) with each row's columns of other slots zeroed (all of them for
    slot -1: no adapter)."""
    column_slot = torch.arange(h.shape[1], device=h.device) // rank
    return h * (slots[:, None] == column_slot[None, :]).to(h.dtype)


class _VocabLoRA(nn.Module):
    """Slots of one vocabulary-wide module: ``lora_a`` (``[in, slots * R]``, A transposed) and
    ``lora_b`` (``[out, slots * R]``) hold every slot side by side (slot ``s``'s rank columns at
    ``s * R``), scaling folded into B."""

    def __init__(self, base: nn.Module, in_size: int, out_size: int, num_slots: int, max_rank: int,
                 mapping: LoRAMapping, dtype: torch.dtype):
        super().__init__()
        self.base, self.max_rank, self.mapping = base, max_rank, mapping
        device = base.weight.device
        self.register_buffer("lora_a", torch.zeros(in_size, num_slots * max_rank, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(out_size, num_slots * max_rank, dtype=dtype, device=device))

    def set_slot(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Slot ``slot``'s (A [r, in], B [out, r]), or None: no adapter here."""
        columns = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        self.lora_a[:, columns].zero_()
        self.lora_b[:, columns].zero_()
        if weights[0] is not None:
            a, b = weights[0]
            r = a.shape[0]
            self.lora_a[:, columns.start:columns.start + r].copy_(a.T)
            self.lora_b[:, columns.start:columns.start + r].copy_(b)


class LoRAEmbedding(_VocabLoRA):
    """The token embedding plus ``A_s[:, id] B_s^T`` for each token of slot ``s`` (a token's
    row of ``lora_a`` is a lookup)."""

    def __init__(self, base: nn.Module, vocab: int, hidden: int, num_slots: int, max_rank: int, mapping: LoRAMapping,
                 dtype: torch.dtype):
        super().__init__(base, vocab, hidden, num_slots, max_rank, mapping, dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        y = self.base(input_ids)
        mapping = self.mapping
        if not mapping.active:
            return y
        ids = input_ids.reshape(-1)
        h = _own_slot(self.lora_a[ids], mapping.token_slots[:ids.shape[0]], self.max_rank)
        return y + (h @ self.lora_b.T).view(y.shape).to(y.dtype)


class LoRALMHead(_VocabLoRA):
    """The LM head plus ``x A_s^T B_s^T`` for each row of slot ``s``: the rows are the step's
    logits rows, whose slots the runner names (:meth:`LoRAMapping.select_logits_rows`)."""

    def __init__(self, base: nn.Module, vocab: int, hidden: int, num_slots: int, max_rank: int, mapping: LoRAMapping,
                 dtype: torch.dtype):
        super().__init__(base, hidden, vocab, num_slots, max_rank, mapping, dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.base(hidden_states)
        mapping = self.mapping
        if not mapping.active:
            return logits
        if mapping.logits_row_slots is None:
            raise RuntimeError("LoRA: the LM head ran on rows the model runner did not name (select_logits_rows)")
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        h = _own_slot(rows.to(self.lora_a.dtype) @ self.lora_a, mapping.logits_row_slots, self.max_rank)
        return logits + (h @ self.lora_b.T).view(logits.shape).to(logits.dtype)
