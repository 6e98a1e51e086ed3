"""KV cache groups: which attention layers share a block table, and which cache tensors each uses.

A block table lists the blocks a request holds; a layer reads its keys through one. Layers that
slide over W tokens need only the blocks of the last W, full-attention layers every block, so
a model mixing both (Gemma 2 and 3, gpt-oss) gets one block table per group of layers of one
window, and each sliding group's table frees the blocks that fell out of its window.

The groups have equal size ``num_slots`` (the smallest per-window layer count; a window's last
group may have fewer layers), and memory is shared across them: the cache holds ``num_slots``
K/V tensor pairs (slots), the i-th layer of every group uses slot i, and block id b of a group
means row b of its layers' slot tensors. All groups draw ids from one pool, so a block costs
``num_slots`` layers of K/V, and a long sequence holds about (full layers x tokens + sliding
layers x window) of it instead of (all layers x tokens).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheGroups:
    # Each group's sliding window in tokens; None: full attention (or a window that never slides).
    windows: tuple[int | None, ...]
    # Each group's layers (indices into the worker's attention layers); its i-th uses slot i.
    layers: tuple[tuple[int, ...], ...]

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        """K/V tensor pairs the cache holds: as many as the first group's layers (no group has more)."""
        return len(self.layers[0])


def group_layers(windows: Sequence[int | None], kv_shapes: Sequence[tuple[int, int]],
                 max_model_len: int) -> KVCacheGroups:
    """Group layers by their sliding window (``windows``, one per layer, None for full attention).

    One distinct window: one group of every layer, each its own slot. Several: groups of the
    smallest per-window layer count, full attention first, then windows from the smallest;
    they share slots, so every layer must have the same ``(num_kv_heads, head_dim)``
    (``kv_shapes``; the dtype is the worker's one). If not, one group keeps every block.
    """
    # A window of max_model_len or more never slides: its layers read every block, as full ones do.
    windows = [None if window is None or window >= max_model_len else window for window in windows]
    distinct = sorted(set(windows), key=lambda window: (window is not None, window or 0))
    every_layer = (tuple(range(len(windows))),)
    if len(distinct) == 1:
        return KVCacheGroups((distinct[0],), every_layer)
    if len(set(kv_shapes)) > 1:
        logger.warning("KV cache: layers slide over windows %s but their (kv heads, head dim) differ (%s), so they "
                       "cannot share cache tensors; every block is kept for every layer",
                       distinct, sorted(set(kv_shapes)))
        return KVCacheGroups((None,), every_layer)
    members = {window: [i for i, own in enumerate(windows) if own == window] for window in distinct}
    size = min(len(layers) for layers in members.values())
    groups = [(window, tuple(layers[start:start + size]))
              for window, layers in members.items() for start in range(0, len(layers), size)]
    return KVCacheGroups(tuple(window for window, _ in groups), tuple(layers for _, layers in groups))
