"""Model-parallel state of this process and the collectives the parallel layers and stages use.

One process runs one rank. ``init_model_parallel`` joins the process group; until then (and
always with one rank) this process is rank 0 of 1 and the parallel layers never touch
``torch.distributed``. The ranks form ``pipeline_parallel_size`` stages of
``tensor_parallel_size`` ranks each: global rank ``r`` is tensor-parallel rank ``r % tp`` of stage
``r // tp``. Tensor-parallel collectives run in the stage's group; a stage hands its hidden
states to the next by point-to-point sends between the ranks of equal tensor-parallel rank (the
pipeline group).

Logits are **all-gathered**: every rank of the last stage receives the full ``[rows, vocab]``
logits, so the runner and the sampler work the same on each and need no "only rank 0 has
logits" case.
"""

from __future__ import annotations

import gc
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hookllm.plugins.contract import capability

_tp_rank = 0
_tp_size = 1
_pp_rank = 0
_pp_size = 1
_tp_group = None  # this stage's tensor-parallel group (None: the world, when there is one stage)
_pp_group = None  # the ranks of this tensor-parallel rank in every stage
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
    """Make this process rank ``rank`` of a ``world_size``-way tensor-parallel group (one
    pipeline stage); see :func:`init_model_parallel`."""
    init_model_parallel(rank, world_size, 1, backend, init_method, device, timeout_s)


def init_model_parallel(
    rank: int,
    world_size: int,
    pipeline_parallel_size: int = 1,
    backend: str | None = None,
    init_method: str = "env://",
    device: torch.device | None = None,
    timeout_s: float = 600.0,
) -> None:
    """Make this process rank ``rank`` of ``world_size`` ranks: ``pipeline_parallel_size`` stages
    of ``world_size // pipeline_parallel_size`` tensor-parallel ranks.

    ``backend`` defaults to NCCL when CUDA is available and gloo otherwise. ``init_method`` is
    any torch.distributed URL (``"tcp://127.0.0.1:29500"``, ``"file:///tmp/x"``, ``"env://"``).
    With NCCL pass this rank's ``device`` (default: the current CUDA device); it becomes the
    current device and the group is bound to it. ``world_size`` 1 creates no process group.
    Call it before the model is built: layers read the ranks and sizes when they are constructed.
    """
    global _tp_rank, _tp_size, _pp_rank, _pp_size, _tp_group, _pp_group
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of size {world_size}")
    if pipeline_parallel_size < 1 or world_size % pipeline_parallel_size:
        raise ValueError(f"{world_size} ranks do not form {pipeline_parallel_size} equal pipeline stages")
    tp_size = world_size // pipeline_parallel_size
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
            raise RuntimeError(f"model-parallel probe all-reduce gave {probe.item()}, expected {world_size}")
        if pipeline_parallel_size > 1:
            # Every rank creates every group, in the same order (torch.distributed's rule).
            for stage in range(pipeline_parallel_size):
                group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
                if stage == rank // tp_size:
                    _tp_group = group
            for tp_rank in range(tp_size):
                group = dist.new_group(list(range(tp_rank, world_size, tp_size)))
                if tp_rank == rank % tp_size:
                    _pp_group = group
    _tp_rank, _tp_size = rank % tp_size, tp_size
    _pp_rank, _pp_size = rank // tp_size, pipeline_parallel_size


def get_tp_rank() -> int:
    """This process's tensor-parallel rank (0 when tensor parallelism is not initialised)."""
    return _tp_rank


def get_tp_size() -> int:
    """The number of tensor-parallel ranks (1 when tensor parallelism is not initialised)."""
    return _tp_size


def get_pp_rank() -> int:
    """This process's pipeline stage (0 when pipeline parallelism is not initialised)."""
    return _pp_rank


def get_pp_size() -> int:
    """The number of pipeline stages (1 when pipeline parallelism is not initialised)."""
    return _pp_size


def is_first_stage() -> bool:
    return _pp_rank == 0


def is_last_stage() -> bool:
    return _pp_rank == _pp_size - 1


def stage_layer_range(num_layers: int, pp_rank: int | None = None, pp_size: int | None = None) -> tuple[int, int]:
    """The ``[start, end)`` decoder layers of a pipeline stage (default: this process's).

    ``HOOKLLM_PP_LAYER_PARTITION="10,12"`` gives each stage's count (they must sum to
    ``num_layers``); otherwise the layers split evenly, the first stages taking one more each
    when they do not divide (the last stage also runs the final norm and the LM head).
    """
    pp_rank = _pp_rank if pp_rank is None else pp_rank
    pp_size = _pp_size if pp_size is None else pp_size
    counts = stage_layer_counts(num_layers, pp_size)
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


def stage_layer_counts(num_layers: int, pp_size: int) -> list[int]:
    """Each stage's decoder-layer count (see :func:`stage_layer_range`); a one-line
    ``ValueError`` where they cannot be made."""
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} is larger than the model's {num_layers} layers")
    partition = os.environ.get("HOOKLLM_PP_LAYER_PARTITION")
    if not partition or pp_size == 1:
        base, extra = divmod(num_layers, pp_size)
        return [base + (stage < extra) for stage in range(pp_size)]
    try:
        counts = [int(part) for part in partition.split(",")]
    except ValueError:
        raise ValueError(f"HOOKLLM_PP_LAYER_PARTITION={partition!r} is not a comma-separated list of layer counts") from None
    if len(counts) != pp_size or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(f"HOOKLLM_PP_LAYER_PARTITION={partition!r} must give {pp_size} positive layer counts "
                         f"summing to {num_layers}")
    return counts


def send_to_next_stage(x: torch.Tensor) -> None:
    """Hand ``x`` to the rank of equal tensor-parallel rank in the next stage."""
    dist.send(x.contiguous(), dist.get_global_rank(_pp_group, _pp_rank + 1), group=_pp_group)


def receive_from_previous_stage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What the previous stage's rank of equal tensor-parallel rank sent (:func:`send_to_next_stage`)."""
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, dist.get_global_rank(_pp_group, _pp_rank - 1), group=_pp_group)
    return x


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
        dist.all_reduce(x, group=_tp_group)
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
    dist.all_gather_into_tensor(flat, x.contiguous(), group=_tp_group)
    stacked = flat.view(_tp_size, *x.shape)
    # [tp, ..., n, ...] -> [..., tp, n, ...] -> [..., tp * n, ...]: rank r's block at r * n.
    return stacked.movedim(0, dim).reshape(*x.shape[:dim], _tp_size * x.shape[dim], *x.shape[dim + 1:])


def destroy_tensor_parallel() -> None:
    """Leave the process group (if any) and go back to rank 0 of 1."""
    global _tp_rank, _tp_size, _pp_rank, _pp_size, _tp_group, _pp_group, _expert_parallel, _custom_all_reduce
    _custom_all_reduce = None
    if dist.is_initialized():
        dist.destroy_process_group()
    _tp_rank, _tp_size, _pp_rank, _pp_size, _expert_parallel = 0, 1, 0, 1, False
    _tp_group = _pp_group = None


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


def check_pipeline_parallel(model_cls: type, hf_config: Any, pp_size: int, world_size: int,
                            num_visible_gpus: int | None = None) -> None:
    """Raise ``ValueError`` if ``model_cls`` cannot run in ``pp_size`` stages on ``hf_config``:
    the class must set ``supports_pipeline_parallel = True``, the stages must fit the layers
    (:func:`stage_layer_counts`) and, on CUDA, the ``world_size`` ranks the visible GPUs."""
    if pp_size == 1:
        return
    if not capability(model_cls, "supports_pipeline_parallel"):
        raise ValueError(f"{model_cls.__name__} does not support pipeline parallelism (pipeline_parallel_size="
                         f"{pp_size}): its class does not set supports_pipeline_parallel = True")
    if num_visible_gpus is not None and world_size > num_visible_gpus:
        raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {world_size} GPUs needed, "
                         f"only {num_visible_gpus} visible")
    config = getattr(hf_config, "text_config", None) or hf_config
    stage_layer_counts(config.num_hidden_layers, pp_size)
