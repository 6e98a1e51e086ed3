"""The base model's projections with per-row LoRA deltas: ``y = base(x) + x A_s^T B_s^T``, ``s``
the adapter slot of the token's request (none: the base model's output alone).

A wrapped projection keeps ``max_loras`` slots of stacked weights: A ``[slots, slices * R, in]``
and B ``[slots, out, R]``, R = ``max_lora_rank`` (smaller ranks zero-padded), the scaling folded
into B. A fused projection (q/k/v, gate/up) is one wrapper whose slices each have their own A and
B: one shrink over all slices' A, one expand writing each slice's columns. Every token of a step
goes through the same two kernel launches whatever its slot, read from :class:`LoRAMapping`,
whose device buffers CUDA graphs capture. On CUDA the shrink, which needs only the input, runs on
a second stream while the base layer's GEMM runs (a graph captures the two branches): only the
expand, which adds into the GEMM's output, lengthens the layer.

The projections are the model's (:class:`hookllm.plugins.contract.SupportsLoRA`), by default
hookllm's parallel linear layers of the native decoders; a plain ``nn.Linear`` (the transformers
backend's) is wrapped the same way, its input of any leading shape.

Tensor parallel: a column-parallel projection keeps A whole (its input is replicated) and this
rank's rows of B; a row-parallel one (o, down) keeps its columns of A, sums the shrunk [T, R]
over the ranks (a small all-reduce), and keeps B whole: the delta is added by every rank after
the base layer's own all-reduce, or by rank 0 alone into a partial sum left to a later reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import torch
from torch import nn

from hookllm.distributed import tensor_model_parallel_all_reduce
from hookllm.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                   RowParallelLinear)
from hookllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from hookllm.lora.vocab import LoRAEmbedding, LoRALMHead

# A wrapped projection's slices, in its output order, by the PEFT module names they load from.
FUSED_SLICES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
ADAPTABLE = (QKVParallelLinear, MergedColumnParallelLinear, ColumnParallelLinear, RowParallelLinear)


@dataclass(frozen=True)
class LoRAProjection:
    """A projection adapters may target: ``parent``'s child ``attr``, whose output columns are the
    PEFT modules ``slices`` under ``prefix`` (``model.layers.3.self_attn``), of ``widths`` columns
    each (None: a parallel layer's own shards, or its whole output)."""

    prefix: str
    parent: nn.Module
    attr: str
    slices: tuple[str, ...]
    widths: tuple[int, ...] | None = None
    kind: Literal["linear", "embedding", "lm_head"] = "linear"  # embedding, LM head: :mod:`hookllm.lora.vocab`


class LoRAMapping:
    """Which tokens of the step run which slot, on the device (read by every wrapped projection):
    ``token_order`` holds the token indices grouped by slot, slot ``s``'s from ``slot_starts[s]``,
    ``slot_counts[s]`` of them; ``token_slots`` each token's slot (for the embedding and LM head).
    ``active`` (host): whether any token of the step has an adapter; a step without one skips the
    kernels (and replays graphs captured without them), so these buffers are written only for
    steps that read them."""

    def __init__(self, num_slots: int, max_tokens: int, device: torch.device):
        # The kernels' grouping in one buffer, written by one copy a step: the starts, the counts,
        # then the order from a 16-byte boundary (Triton compiles a kernel variant per pointer alignment).
        self.order_offset = -(-2 * num_slots // 4) * 4
        self.buffer = torch.zeros(self.order_offset + max_tokens, dtype=torch.int32, device=device)
        self.slot_starts, self.slot_counts = self.buffer[:num_slots], self.buffer[num_slots:2 * num_slots]
        self.token_order = self.buffer[self.order_offset:]
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)  # each token's, or -1
        self.logits_row_slots: torch.Tensor | None = None  # the slot of each row the LM head gets next
        self.active = False  # set by each step (LoRAManager.prepare_step) and by the CUDA graph capture
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def select_logits_rows(self, token_indices: torch.Tensor | None, count: int) -> None:
        """The LM head's next rows are the step's tokens ``token_indices`` (None: its first ``count``)."""
        self.logits_row_slots = (self.token_slots[:count] if token_indices is None
                                 else self.token_slots[token_indices])


class LoRALinear(nn.Module):
    """``base`` (a parallel linear layer or an ``nn.Linear``, loaded) plus each token's slot's delta."""

    def __init__(self, base: nn.Module, slices: tuple[str, ...], widths: tuple[int, ...] | None, num_slots: int,
                 max_rank: int, mapping: LoRAMapping, kernels: ModuleType, dtype: torch.dtype):
        super().__init__()
        self.base = base
        self.slices = slices
        self.max_rank = max_rank
        self.mapping = mapping
        self.kernels = kernels
        out_size, in_size = base.weight.shape
        if widths is not None:
            starts = [sum(widths[:i]) for i in range(len(widths))]
        elif isinstance(base, (QKVParallelLinear, MergedColumnParallelLinear)):
            starts = [base.shard_offsets[shard][0] for shard in _shard_names(base)]
        else:
            starts = [0]
        self.slice_starts = tuple(starts) + (out_size,)
        device = base.weight.device
        # Persistent buffers: the engine's memory budget counts them with the weights.
        self.register_buffer("lora_a", torch.zeros(num_slots, len(slices) * max_rank, in_size, dtype=dtype,
                                                   device=device))
        self.register_buffer("lora_b", torch.zeros(num_slots, out_size, max_rank, dtype=dtype, device=device))
        self.row_parallel = isinstance(base, RowParallelLinear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mapping = self.mapping
        if not mapping.active:
            return self.base(x)
        rows = x.reshape(-1, x.shape[-1])  # the transformers backend's [1, T, in]
        side = mapping.side_stream
        if side is None:
            y = self.base(x)
            shrunk = self._shrink(rows)
        else:
            # Every use of the side stream starts after the main stream's work so far, so the
            # buffers it reads or reuses are no longer needed there; the main one waits for it.
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                shrunk = self._shrink(rows)
            y = self.base(x)
            main.wait_stream(side)
        base = self.base
        if self.row_parallel and base.tp_size > 1:
            # Each rank shrank its columns of x: the sum over ranks is the whole product.
            shrunk = tensor_model_parallel_all_reduce(shrunk.sum(0, keepdim=True))
            if not base.reduce_results and base.tp_rank != 0:
                return y  # a partial sum: rank 0 adds the delta once
        self.kernels.lora_expand(y.view(-1, y.shape[-1]), shrunk, self.lora_b, self.slice_starts, mapping.token_order,
                                 mapping.slot_starts, mapping.slot_counts)
        return y

    def _shrink(self, x: torch.Tensor) -> torch.Tensor:
        mapping = self.mapping
        return self.kernels.lora_shrink(x, self.lora_a, mapping.token_order, mapping.slot_starts, mapping.slot_counts)

    def set_slot(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Load slot ``slot`` with one (A [r, in], B [out, r]) per slice, full checkpoint shapes
        (None: the adapter leaves that slice alone); this rank copies its shard."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        base, rank = self.base, self.max_rank
        sharded = hasattr(base, "_in_range")  # a parallel layer; else a whole nn.Linear
        first_col, cols, _ = base._in_range() if sharded else (0, base.weight.shape[1], None)
        shards = _shard_names(base) if sharded and len(self.slices) > 1 else [None] * len(self.slices)
        for index, (shard, pair) in enumerate(zip(shards, weights)):
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            if sharded:
                local_row, row, rows, _ = base._out_range(shard)
            else:
                local_row, row, rows = self.slice_starts[index], 0, b.shape[0]
            self.lora_a[slot, index * rank:index * rank + r].copy_(a[:, first_col:first_col + cols])
            self.lora_b[slot, local_row:local_row + rows, :r].copy_(b[row:row + rows])


def _shard_names(base: nn.Module) -> list[str]:
    return list(base.shard_offsets) if hasattr(base, "shard_offsets") else []


def parallel_projections(model: nn.Module) -> list[LoRAProjection]:
    """The native decoders' projections: hookllm's parallel linear layers under ``model.layers.*``
    (``qkv_proj`` and ``gate_up_proj`` each one projection of its PEFT modules), the token
    embedding ``model.embed_tokens`` and the LM head ``lm_head``."""
    projections = []
    for name, module in model.named_modules():
        parent_name, _, attr = name.rpartition(".")
        if isinstance(module, ADAPTABLE) and parent_name.startswith("model.layers."):
            projections.append(LoRAProjection(parent_name, model.get_submodule(parent_name), attr,
                                              FUSED_SLICES.get(attr, (attr,))))
        elif name == "lm_head" and isinstance(module, ParallelLMHead):
            projections.append(LoRAProjection("", model, attr, (attr,), kind="lm_head"))
        elif name == "model.embed_tokens" and isinstance(module, VocabParallelEmbedding):
            projections.append(LoRAProjection(parent_name, model.get_submodule(parent_name), attr, (attr,),
                                              kind="embedding"))
    return projections


def wrap_projections(projections: list[LoRAProjection], num_slots: int, max_rank: int, mapping: LoRAMapping,
                     kernels: ModuleType, dtype: torch.dtype) -> dict[str, tuple[nn.Module, int]]:
    """Replace each projection by its LoRA wrapper (slots in ``dtype``, the activations'):
    :class:`LoRALinear`, :class:`~hookllm.lora.vocab.LoRAEmbedding` or
    :class:`~hookllm.lora.vocab.LoRALMHead`; returns each PEFT module name's (wrapper, slice index)."""
    targets: dict[str, tuple[nn.Module, int]] = {}
    for projection in projections:
        base = getattr(projection.parent, projection.attr)
        if projection.kind == "linear":
            wrapper = LoRALinear(base, projection.slices, projection.widths, num_slots, max_rank, mapping, kernels,
                                 dtype)
        else:
            # nn.Embedding / VocabParallelEmbedding / ParallelLMHead name their sizes so; nn.Linear (a head) so.
            vocab = getattr(base, "num_embeddings", None) or base.out_features
            hidden = getattr(base, "embedding_dim", None) or base.in_features
            vocab_wrapper = LoRAEmbedding if projection.kind == "embedding" else LoRALMHead
            wrapper = vocab_wrapper(base, vocab, hidden, num_slots, max_rank, mapping, dtype)
        setattr(projection.parent, projection.attr, wrapper)
        for index, peft_name in enumerate(projection.slices):
            targets[f"{projection.prefix}.{peft_name}" if projection.prefix else peft_name] = (wrapper, index)
    return targets


def lora_kernels(attention_backend: str) -> ModuleType:
    """The module with ``lora_shrink`` and ``lora_expand``: the Triton kernels where attention runs
    Triton's (CUDA, or the interpreter on the CPU), else their torch references."""
    if attention_backend == "triton":
        from hookllm.kernels import triton_lora

        return triton_lora
    from hookllm.kernels import reference

    return reference
