"""Tensor-parallel linear layers, including the fused projections (qkv, gate/up).

Parallel layers read this process's rank and size from `hookllm.distributed` when built and
keep only this rank's shard of each weight. Each has a ``weight_loader`` that takes the FULL
checkpoint tensor, or a lazy safetensors slice (``safe_open(...).get_slice(name)``), and copies
only this rank's rows or columns, so a rank never reads the other ranks' shards from disk.
With one rank they are plain matmuls: no collective, no extra copy.

Every layer describes its shard once (``_out_range`` / ``_in_range``: which checkpoint rows and
columns it holds) and one ``weight_loader`` copies any parameter from that: the weight, the
bias, and a quantization method's scales, whose :class:`ParamLayout` says how their dims follow
the weight's (a block-quantized checkpoint's scale has a row per block of rows). A quantization
method (:mod:`hookllm.plugins.quantization`) replaces the parameters and sets ``quant_method``,
whose ``apply`` then does the layer's matmul.

- `ColumnParallelLinear`: output dim split; no communication (the next layer consumes the shard).
- `MergedColumnParallelLinear`: several projections stacked on the output dim (gate/up), each split.
- `QKVParallelLinear`: q/k/v split by heads; KV heads replicated when there are fewer than ranks.
- `RowParallelLinear`: input dim split; one all-reduce of the partial sums, then the bias once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from hookllm.distributed import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce

if TYPE_CHECKING:
    from hookllm.plugins.quantization import LinearMethod

# A checkpoint tensor or a lazy safetensors slice (anything with get_shape() and [slices]).
LoadedWeight = Any


def loaded_shape(loaded: LoadedWeight) -> tuple[int, ...]:
    """The full shape of a checkpoint tensor or lazy slice, without reading its data."""
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def materialize(loaded: LoadedWeight) -> torch.Tensor:
    """The whole tensor (reads a lazy slice entirely)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded[...]


def narrow_loaded(loaded: LoadedWeight, dim: int, start: int, size: int) -> torch.Tensor:
    """Rows ``start:start+size`` of ``dim``; a lazy slice reads only those from the file."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    return loaded[(slice(None),) * dim + (slice(start, start + size),)]


def check_loaded_shape(loaded: LoadedWeight, expected: tuple[int, ...], what: str) -> None:
    """Raise ``ValueError`` unless the checkpoint tensor has the full (unsharded) shape ``expected``."""
    if loaded_shape(loaded) != expected:
        raise ValueError(f"{what}: checkpoint shape {loaded_shape(loaded)} != expected {expected}")


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={parts}")
    return total // parts


@dataclass(frozen=True)
class ParamLayout:
    """How a parameter of a linear layer lines up with its weight ``[out, in]``.

    ``dims``: what each of the parameter's leading dims follows, ``"out"`` (rows) or ``"in"``
    (columns); later dims are copied whole. The checkpoint's tensor has ``ceil(size / block)``
    entries along a dim of block ``out_block`` / ``in_block``: an ``"out"`` dim is expanded to one
    entry per row (so fused shards need not align to blocks), an ``"in"`` dim keeps its blocks
    (a rank's columns must start on one). ``scalar_fill``: a one-element checkpoint tensor fills
    the shard's rows (a per-tensor scale of q, k or v in a fused layer's per-row scales).
    ``reduce_max``: the parameter keeps the largest value loaded into it (one static activation
    scale for the q, k and v shards)."""

    dims: tuple[str, ...] = ("out", "in")
    out_block: int = 1
    in_block: int = 1
    scalar_fill: bool = False
    reduce_max: bool = False


WEIGHT_LAYOUT = ParamLayout()
VECTOR_LAYOUT = ParamLayout(("out",))


def _blocks(start: int, size: int, block: int) -> tuple[int, int]:
    """The range of blocks of ``block`` entries covering ``start:start+size``."""
    return start // block, -(-(start + size) // block) - start // block


class _ShardedLinear(nn.Module):
    """Parameters ``weight`` [out, in] and optional ``bias`` [bias_size], left uninitialised
    (the loader or the dummy initialiser fills them), and the rank they belong to.

    Subclasses say which checkpoint rows a shard holds (``_out_range``) and which columns
    (``_in_range``); one loader serves every parameter from that."""

    def __init__(self, local_in: int, local_out: int, bias_size: int | None):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.weight = nn.Parameter(torch.empty(local_out, local_in), requires_grad=False)
        if bias_size is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(torch.empty(bias_size), requires_grad=False)
        self.quant_method: LinearMethod | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias`` on this rank's shard, through the quantization method if any."""
        if self.quant_method is None:
            return F.linear(x, self.weight, bias)
        return self.quant_method.apply(self, x, bias)

    def _out_range(self, shard: str | None) -> tuple[int, int, int, int]:
        """(first local row, first checkpoint row, rows, checkpoint rows of the shard's tensor)."""
        raise NotImplementedError

    def _in_range(self) -> tuple[int, int, int]:
        """(first checkpoint column, columns, checkpoint columns)."""
        return 0, self.weight.shape[1], self.weight.shape[1]

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard: str | None = None) -> None:
        """Copy this rank's part of checkpoint tensor ``loaded`` (shard ``shard`` of a fused
        layer) into ``param``, as the parameter's ``param_layout`` (default: the weight's, or a
        vector's) lines it up with the weight."""
        layout = getattr(param, "param_layout", WEIGHT_LAYOUT if param.dim() > 1 else VECTOR_LAYOUT)
        what = type(self).__name__ + ("" if shard is None else f" shard {shard!r}")
        local_row, row, rows, total_rows = self._out_range(shard)
        col, cols, total_cols = self._in_range()
        if layout.scalar_fill and math.prod(loaded_shape(loaded)) == 1:
            value = materialize(loaded).reshape(())
            param.data.narrow(0, local_row, rows).copy_(value)
            return
        full = tuple(-(-total_rows // layout.out_block) if d == "out" else -(-total_cols // layout.in_block)
                     for d in layout.dims) + tuple(param.shape[len(layout.dims):])
        check_loaded_shape(loaded, full, what)
        part = loaded
        for dim, kind in enumerate(layout.dims):
            if kind == "in" and cols != total_cols:
                if col % layout.in_block:
                    raise ValueError(f"{what}: this rank's columns start at {col}, inside a quantization "
                                     f"block of {layout.in_block}")
                part = narrow_loaded(part, dim, *_blocks(col, cols, layout.in_block))
            elif kind == "out" and (rows != total_rows or layout.out_block > 1):
                first, count = _blocks(row, rows, layout.out_block)
                part = narrow_loaded(part, dim, first, count)
                if layout.out_block > 1:
                    offset = row - first * layout.out_block
                    part = part.repeat_interleave(layout.out_block, dim=dim).narrow(dim, offset, rows)
        part = materialize(part)
        target = param.data.narrow(0, local_row, rows) if "out" in layout.dims else param.data
        if layout.reduce_max:
            torch.maximum(target, part.to(target.dtype).reshape(target.shape), out=target)
        else:
            target.copy_(part)


class ColumnParallelLinear(_ShardedLinear):
    """``y = x W^T + b`` with W's output rows split evenly: rank r computes outputs
    ``[r * n, (r + 1) * n)``, ``n = output_size / tp``. The output stays sharded."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        local = _divide(output_size, get_tp_size(), "output_size")
        super().__init__(input_size, local, local if bias else None)
        self.input_size, self.output_size = input_size, output_size

    def _out_range(self, shard: str | None) -> tuple[int, int, int, int]:
        local = self.weight.shape[0]
        return 0, self.tp_rank * local, local, self.output_size


class MergedColumnParallelLinear(_ShardedLinear):
    """Several column-parallel projections in one matmul (gate and up): each is split across
    ranks, and the local weight stacks this rank's part of each, in order."""

    def __init__(self, input_size: int, output_sizes: dict[str, int], bias: bool = False):
        tp = get_tp_size()
        self.output_sizes = dict(output_sizes)
        self.shard_offsets: dict[str, tuple[int, int]] = {}  # shard -> (local start, local size)
        start = 0
        for name, size in output_sizes.items():
            local = _divide(size, tp, f"{name} output_size")
            self.shard_offsets[name] = (start, local)
            start += local
        super().__init__(input_size, start, start if bias else None)

    def _out_range(self, shard: str | None) -> tuple[int, int, int, int]:
        start, size = self.shard_offsets[shard]
        return start, self.tp_rank * size, size, self.output_sizes[shard]


class QKVParallelLinear(_ShardedLinear):
    """Fused q/k/v projection split by attention heads.

    Rank r holds query heads ``[r * H / tp, (r + 1) * H / tp)``. With at least as many KV heads
    as ranks it holds ``KV / tp`` of them; with fewer (``tp % KV == 0``) each rank holds the one
    KV head its query heads attend to (head ``r * KV // tp``), replicated on ``tp / KV`` ranks.
    ``num_heads`` and ``num_kv_heads`` are this rank's counts.
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False):
        tp = get_tp_size()
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp, "num_attention_heads")
        if total_num_kv_heads >= tp:
            self.num_kv_heads = _divide(total_num_kv_heads, tp, "num_key_value_heads")
        elif tp % total_num_kv_heads:
            raise ValueError(
                f"num_key_value_heads={total_num_kv_heads} neither divides nor is divisible by "
                f"tensor_parallel_size={tp}"
            )
        else:
            self.num_kv_heads = 1
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.shard_offsets = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
        super().__init__(hidden_size, q + 2 * kv, q + 2 * kv if bias else None)

    def _first_head(self, shard: str) -> int:
        """The first checkpoint head of ``shard`` that this rank holds."""
        if shard == "q":
            return self.tp_rank * self.num_heads
        if self.total_num_kv_heads >= self.tp_size:
            return self.tp_rank * self.num_kv_heads
        return self.tp_rank * self.total_num_kv_heads // self.tp_size

    def _out_range(self, shard: str | None) -> tuple[int, int, int, int]:
        start, size = self.shard_offsets[shard]
        total_heads = self.total_num_heads if shard == "q" else self.total_num_kv_heads
        return start, self._first_head(shard) * self.head_dim, size, total_heads * self.head_dim


class RowParallelLinear(_ShardedLinear):
    """``y = x W^T + b`` with W's input columns split: rank r multiplies its slice of ``x``
    (the sharded output of a column-parallel layer) by its columns, then one all-reduce sums the
    partial products. The bias is replicated and added once, after the sum.

    ``reduce_results=False`` leaves the sum to the caller, which adds this partial output to
    others first and reduces them together (Qwen2-MoE's shared expert joins the experts' sum);
    the bias is then added by rank 0 alone."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True):
        local = _divide(input_size, get_tp_size(), "input_size")
        super().__init__(local, output_size, output_size if bias else None)
        self.input_size, self.output_size = input_size, output_size
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.matmul(x, self.bias)
        if not self.reduce_results:
            return self.matmul(x, self.bias if self.tp_rank == 0 else None)
        out = tensor_model_parallel_all_reduce(self.matmul(x, None))
        return out if self.bias is None else out + self.bias

    def _out_range(self, shard: str | None) -> tuple[int, int, int, int]:
        return 0, 0, self.output_size, self.output_size

    def _in_range(self) -> tuple[int, int, int]:
        local = self.weight.shape[1]
        return self.tp_rank * local, local, self.input_size
