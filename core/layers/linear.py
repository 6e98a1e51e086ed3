"""Linear layers that fuse several checkpoint projections into one matmul (qkv, gate_up)."""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """One weight holding several checkpoint projections stacked on the output dim.

    ``shard_sizes`` maps a shard name (e.g. ``"q"``, ``"k"``, ``"v"``) to its output rows, in
    order; ``load_shard`` copies a checkpoint tensor into its rows of ``weight`` or ``bias``.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (start, size)
            start += size

    def load_shard(self, param: nn.Parameter, shard: str, loaded: torch.Tensor) -> None:
        start, size = self.shard_offsets[shard]
        target = param.data.narrow(0, start, size)
        if target.shape != loaded.shape:
            raise ValueError(f"shard {shard!r}: checkpoint shape {tuple(loaded.shape)} != expected {tuple(target.shape)}")
        target.copy_(loaded)
