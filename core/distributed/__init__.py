"""Tensor-parallel state of this process and the two collectives the parallel layers use.

One process runs one rank. ``init_tensor_parallel`` joins the process group; until then (and
always with ``tensor_parallel_size == 1``) this process is rank 0 of 1 and the parallel layers
never touch ``torch.distributed``. All ranks form one tensor-parallel group (there is no
pipeline or data parallelism), so the group is the default (world) group.

Logits are **all-gathered**: every rank receives the full ``[rows, vocab]`` logits, so the
runner and the sampler work the same on every rank and need no "only rank 0 has logits" case.
"""

from __future__ import annotations

import gc
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hookllm.plugins.contract import capability

_tp_rank = 0
_tp_size = 1
_expert_parallel = False
_custom_all_reduce = None  # hookllm.distributed.custom_all_reduce.CustomAllReduce, once init_custom_all_reduce made it


def init_tensor_parallel(
    rank: int,
    world_size: int,
    backend: str | None = None,
    init_method: str = "env://",
    device: torch.device | None = None,
    timeout_s: float = 600.0,
) -> None:
    """Make this process rank ``rank`` of a ``world_size``-way tensor-parallel group.

    ``backend`` defaults to NCCL when CUDA is available and gloo otherwise. ``init_method`` is
    any torch.distributed URL (``"tcp://127.0.0.1:29500"``, ``"file:///tmp/x"``, ``"env://"``).
    With NCCL pass this rank's ``device`` (default: the current CUDA device); it becomes the
    current device and the group is bound to it. ``world_size`` 1 creates no process group.
    Call it before the model is built: layers read the rank and size when they are constructed.
    """
    global _tp_rank, _tp_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of size {world_size}")
    if world_size > 1:
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            device = device or torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        dist.init_process_group(
            backend, init_method=init_method, world_size=world_size, rank=rank,
            timeout=timedelta(seconds=timeout_s), device_id=device if backend == "nccl" else None,
        )
        # A first collective here, so a broken setup fails at start-up rather than mid-forward.
        probe = torch.ones(1, device=device)
        dist.all_reduce(probe)
        if probe.item() != world_size:
            raise RuntimeError(f"tensor-parallel probe all-reduce gave {probe.item()}, expected {world_size}")
    _tp_rank, _tp_size = rank, world_size


def get_tp_rank() -> int:
    """This process's tensor-parallel rank (0 when tensor parallelism is not initialised)."""
    return _tp_rank


def get_tp_size() -> int:
    """The number of tensor-parallel ranks (1 when tensor parallelism is not initialised)."""
    return _tp_size


def set_expert_parallel(enabled: bool) -> None:
    """Whether MoE layers built from now on place whole experts on ranks (``--enable-expert-parallel``)
    rather than splitting every expert's intermediate dimension; set by the worker before it
    builds the model."""
    global _expert_parallel
    _expert_parallel = bool(enabled)


def expert_parallel_enabled() -> bool:
    return _expert_parallel


def init_custom_all_reduce(device: torch.device, max_bytes: int | None = None) -> bool:
    """Take small all-reduces off NCCL (``hookllm.distributed.custom_all_reduce``): a collective, after
    ``init_tensor_parallel``. Returns False, and NCCL keeps every all-reduce, where the ranks'
    GPUs cannot reach each other's memory."""
    global _custom_all_reduce
    from hookllm.distributed.custom_all_reduce import DEFAULT_MAX_BYTES, CustomAllReduce

    if _tp_size == 1:
        return False
    if device.type == "cuda":
        reachable = torch.tensor([all(torch.cuda.can_device_access_peer(device, torch.device("cuda", peer))
                                      for peer in range(torch.cuda.device_count()) if peer != device.index)],
                                 dtype=torch.int32, device=device)
        dist.all_reduce(reachable, op=dist.ReduceOp.MIN)  # every rank decides alike
        if not reachable.item():
            return False
    _custom_all_reduce = CustomAllReduce(device, max_bytes or DEFAULT_MAX_BYTES)
    return True


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place; returns ``x`` (untouched with one rank). Small messages
    go through the one-shot kernel once ``init_custom_all_reduce`` ran, the rest through NCCL."""
    if _tp_size > 1:
        if _custom_all_reduce is not None and _custom_all_reduce.can_reduce(x):
            return _custom_all_reduce.all_reduce(x)
        dist.all_reduce(x)
    return x


def custom_all_reduce_enabled() -> bool:
    """Whether ``init_custom_all_reduce`` took small all-reduces off NCCL in this process (models
    then leave their row-parallel sums to the norm after them: ``custom_all_reduce_rms_norm``)."""
    return _custom_all_reduce is not None


def custom_all_reduce_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rms_norm(sum(x) + residual), sum(x) + residual)`` with ``x`` each rank's partial sum, in
    one launch of the one-shot kernel (``x`` is overwritten); None where that kernel does not take
    ``x``, for the caller to all-reduce it and norm as usual."""
    if _custom_all_reduce is not None and _custom_all_reduce.can_reduce(x):
        return _custom_all_reduce.all_reduce_rms_norm(x, residual, weight, eps)
    return None


def tensor_model_parallel_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order, on every rank (all-gather).

    All ranks must pass the same shape. Returns ``x`` itself with one rank.
    """
    if _tp_size == 1:
        return x
    dim = dim % x.dim()
    # Concatenated along dim 0 (the output layout both NCCL and gloo accept), seen as [tp, *shape].
    flat = torch.empty((_tp_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(flat, x.contiguous())
    stacked = flat.view(_tp_size, *x.shape)
    # [tp, ..., n, ...] -> [..., tp, n, ...] -> [..., tp * n, ...]: rank r's block at r * n.
    return stacked.movedim(0, dim).reshape(*x.shape[:dim], _tp_size * x.shape[dim], *x.shape[dim + 1:])


def destroy_tensor_parallel() -> None:
    """Leave the process group (if any) and go back to rank 0 of 1."""
    global _tp_rank, _tp_size, _expert_parallel, _custom_all_reduce
    _custom_all_reduce = None
    if dist.is_initialized():
        dist.destroy_process_group()
    _tp_rank, _tp_size, _expert_parallel = 0, 1, False


def cleanup_dist_env_and_memory() -> None:
    """Tear down tensor parallelism and release memory: between engines, or at the end of a test."""
    destroy_tensor_parallel()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_tensor_parallel(model_cls: type, hf_config: Any, tp_size: int, num_visible_gpus: int | None = None) -> None:
    """Raise ``ValueError`` if ``model_cls`` cannot run ``tp_size``-way on ``hf_config``.

    Call it before anything is built or loaded. Checks: the class opted in with
    ``supports_tensor_parallel = True``; ``num_attention_heads`` divisible by ``tp_size``;
    ``num_key_value_heads`` divisible by ``tp_size`` or dividing it (then KV heads are
    replicated); ``intermediate_size`` divisible by ``tp_size``; and, when
    ``num_visible_gpus`` is given (CUDA), ``tp_size`` no larger than it. Fields the (text)
    config lacks are not checked. The vocabulary needs no check: it is padded to a multiple
    of ``tp_size``.
    """
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    if tp_size == 1:
        return
    if not capability(model_cls, "supports_tensor_parallel"):
        raise ValueError(
            f"{model_cls.__name__} does not support tensor parallelism (tensor_parallel_size={tp_size}): "
            "its class does not set supports_tensor_parallel = True"
        )
    if num_visible_gpus is not None and tp_size > num_visible_gpus:
        raise ValueError(f"tensor_parallel_size={tp_size} needs {tp_size} GPUs, only {num_visible_gpus} visible")
    config = getattr(hf_config, "text_config", None) or hf_config
    heads = getattr(config, "num_attention_heads", None)
    if heads is not None and heads % tp_size:
        raise ValueError(f"num_attention_heads={heads} is not divisible by tensor_parallel_size={tp_size}")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if kv_heads is not None and kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(
            f"num_key_value_heads={kv_heads} must be divisible by tensor_parallel_size={tp_size} "
            "or divide it (KV heads are then replicated)"
        )
    intermediate = getattr(config, "intermediate_size", None)
    if intermediate is not None and intermediate % tp_size:
        raise ValueError(f"intermediate_size={intermediate} is not divisible by tensor_parallel_size={tp_size}")
