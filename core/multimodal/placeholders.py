"""Placeholder expansion: a prompt's one token per media item becomes the item's rows."""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

from hookllm.plugins.contract import Placeholder
from hookllm.sched.request import MultiModalItem


def content_hash(data: torch.Tensor) -> str:
    """SHA-256 of an item's preprocessed values: equal items share encoder output and KV blocks."""
    return hashlib.sha256(data.contiguous().numpy().tobytes()).hexdigest()


def expand_placeholders(token_ids: Sequence[int], modality: str, placeholder: Placeholder,
                        data: Sequence[torch.Tensor]) -> tuple[list[int], list[MultiModalItem]]:
    """Each ``placeholder.token_id`` in ``token_ids`` (the i-th standing for ``data[i]``) becomes
    ``placeholder.num_rows`` of them: the expanded ids, and one item per placeholder with its
    offset in them. The caller checks first that the counts agree."""
    items = iter(data)
    expanded: list[int] = []
    mm_items: list[MultiModalItem] = []
    for token in token_ids:
        if token == placeholder.token_id:
            item = next(items)
            mm_items.append(MultiModalItem(modality, len(expanded), placeholder.num_rows, content_hash(item), item))
            expanded.extend([token] * placeholder.num_rows)
        else:
            expanded.append(token)
    return expanded, mm_items
