"""A one-shot all-reduce for small messages between the ranks of one host (NCCL stays the fallback).

A decode step's all-reduces are small (batch x hidden in bf16: 0.5 MB at batch 64 of the 8B
shape) and there are two per layer; NCCL's ring takes tens of microseconds for each. Here every
rank's buffer is mapped into every other rank (CUDA IPC handles, which torch shares between
processes), and one kernel per call copies this rank's rows in, meets the other ranks on their
signal pads, and sums every rank's rows (``hookllm.kernels.triton_all_reduce``), optionally
with the residual add and RMSNorm that follow it in a layer.

On the CPU the buffers are shared-memory files, and the same kernel runs under
``TRITON_INTERPRET=1`` (or the torch reference): how its correctness is checked against gloo.

What it does not take, it leaves to ``torch.distributed.all_reduce``: messages above
``max_bytes``, tensors that are not contiguous or not 2-D after flattening, GPUs without peer
access to each other.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hookllm.kernels.triton_all_reduce import MAX_PROGRAMS

# Above this a one-shot read of every rank's message costs more than NCCL's ring (to be set
# from measurements on two GPUs; vLLM's one-shot range on NVLink is of this order).
DEFAULT_MAX_BYTES = 512 * 1024
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class PeerMemory:
    """Every rank's all-reduce buffer and signal pad, as mapped in this process."""

    rank: int
    buffers: list[torch.Tensor]  # uint8, one per rank, ``max_bytes`` each
    signals: list[torch.Tensor]  # int32 ``[MAX_PROGRAMS * world]`` each, zeroed at creation
    epochs: torch.Tensor  # int32 ``[MAX_PROGRAMS]``: this rank's barrier counters, one per program
    buffer_table: torch.Tensor  # int64 addresses of ``buffers`` here, on the device (for the kernel)
    signal_table: torch.Tensor


def _share_cuda(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> list[list[torch.Tensor]]:
    """Each rank's ``tensors``, mapped into this process through CUDA IPC (this rank's own as they are)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    handles = [None] * dist.get_world_size(group)
    dist.all_gather_object(handles, [reduce_tensor(t)[1] for t in tensors], group=group)
    rank = dist.get_rank(group)
    return [tensors if r == rank else [rebuild_cuda_tensor(*args) for args in handles[r]]
            for r in range(len(handles))]


def _share_files(tensors_bytes: list[int], group: dist.ProcessGroup) -> list[list[torch.Tensor]]:
    """Zeroed shared-memory tensors (uint8) of the given sizes for each rank, every rank's
    mapped here; the files are removed once every rank has mapped them."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    names = [os.path.join(folder, f"hookllm-allreduce-{uuid.uuid4().hex}-{i}") for i in range(len(tensors_bytes))]
    for name, size in zip(names, tensors_bytes):
        with open(name, "wb") as f:
            f.truncate(size)
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, names, group=group)
    mapped = [[torch.from_file(name, shared=True, size=size, dtype=torch.uint8) for name, size in zip(theirs, tensors_bytes)]
              for theirs in every]
    dist.barrier(group=group)
    for name in names:
        os.unlink(name)
    return mapped


def create_peer_memory(max_bytes: int, device: torch.device, group: dist.ProcessGroup | None = None) -> PeerMemory:
    """This rank's buffer and signal pad, every other rank's mapped beside them (a collective:
    every rank of ``group`` calls it)."""
    group = group or dist.group.WORLD
    rank = dist.get_rank(group)
    pad_bytes = MAX_PROGRAMS * dist.get_world_size(group) * 4
    if device.type == "cuda":
        own = [torch.empty(max_bytes, dtype=torch.uint8, device=device),
               torch.zeros(pad_bytes, dtype=torch.uint8, device=device)]
        torch.cuda.synchronize(device)  # the pads are zero before any peer signals into them
        mapped = _share_cuda(own, group)
    else:
        mapped = _share_files([max_bytes, pad_bytes], group)
    buffers = [m[0] for m in mapped]
    signals = [m[1].view(torch.int32) for m in mapped]
    table = torch.tensor([[b.data_ptr() for b in buffers], [s.data_ptr() for s in signals]], dtype=torch.int64)
    table = table.to(device)
    dist.barrier(group=group)
    return PeerMemory(rank, buffers, signals, torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=device),
                      table[0], table[1])


class CustomAllReduce:
    """The one-shot all-reduce of this rank, for messages up to ``max_bytes``."""

    def __init__(self, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES, group: dist.ProcessGroup | None = None):
        self.max_bytes = max_bytes
        self.device = device
        self.peers = create_peer_memory(max_bytes, device, group)

    def can_reduce(self, x: torch.Tensor) -> bool:
        """Whether this call takes ``x`` (else NCCL's): small, contiguous, a supported dtype, here."""
        return (x.device == self.device and x.dtype in SUPPORTED_DTYPES and x.is_contiguous() and x.dim() >= 1
                and x.numel() * x.element_size() <= self.max_bytes)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks in place; returns ``x``."""
        self._kernel(x).one_shot_all_reduce(x.view(-1, x.shape[-1]), self.peers)
        return x

    def all_reduce_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(sum(x) + residual), sum(x) + residual)``: the first in ``x`` itself, the second new."""
        cols = x.shape[-1]
        _, hidden = self._kernel(x).one_shot_all_reduce(x.view(-1, cols), self.peers, residual.reshape(-1, cols),
                                                        weight, eps)
        return x, hidden.view(residual.shape)

    @staticmethod
    def _kernel(x: torch.Tensor):
        # The Triton kernel on CUDA, and on the CPU under the interpreter; the torch reference otherwise.
        if x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
            from hookllm.kernels import triton_all_reduce

            return triton_all_reduce
        from hookllm.kernels import reference

        return reference
