"""The one-shot all-reduce between the ranks of one host, as a Triton kernel.

Every rank's ``x`` is summed into every rank's ``x``, with one launch per rank and no NCCL:
each rank's buffer is mapped into every other rank's address space (CUDA IPC; shared memory on
the CPU), so a program loads its rows straight from all of them. Program ``p`` of each rank

1. copies rows ``p, p + G, ...`` of its ``x`` into its own buffer,
2. writes the call's epoch into slot ``(p, rank)`` of every rank's signal pad and waits until
   its own pad's slots ``(p, r)`` hold it for every rank ``r`` (their rows are in place),
3. sums those rows of every buffer in rank order (float32; the same bits on every rank), adds
   the residual and applies RMSNorm when asked, and writes the result over ``x`` (the new
   residual, ``sum + residual``, into a tensor of its own),
4. meets the other ranks' program ``p`` once more (epoch + 1), so no rank's next call writes
   its buffer while another still reads it.

The epochs live on the device (one counter per program, advanced by the kernel itself), so a
CUDA graph replays the kernel as it is. The grid never exceeds ``MAX_PROGRAMS``: every program
spins on its counterparts, so all must be resident at once. Twin of
:func:`hookllm.kernels.reference.one_shot_all_reduce`, the same signature; ``peers`` is a
:class:`hookllm.distributed.custom_all_reduce.PeerMemory`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Programs per call at most (and signal-pad slots per rank): each is resident while it spins.
MAX_PROGRAMS = 32


@triton.jit
def _meet(signal_table_ptr, program, epoch, RANK: tl.constexpr, WORLD: tl.constexpr):
    # Every thread's stores above are done before the signal leaves (release, system scope:
    # the readers are other GPUs or processes).
    tl.debug_barrier()
    for r in tl.static_range(WORLD):
        pad = tl.load(signal_table_ptr + r).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(pad + program * WORLD + RANK, epoch, sem="release", scope="sys")
    own = tl.load(signal_table_ptr + RANK).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(WORLD):
        while tl.atomic_add(own + program * WORLD + r, 0, sem="acquire", scope="sys") < epoch:
            pass
    tl.debug_barrier()


@triton.jit
def _one_shot_all_reduce_kernel(x_ptr, buffer_table_ptr, signal_table_ptr, epochs_ptr, residual_ptr, residual_out_ptr,
                                weight_ptr, rows, cols, eps, RANK: tl.constexpr, WORLD: tl.constexpr,
                                NORM: tl.constexpr, BLOCK: tl.constexpr):
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    offsets = tl.arange(0, BLOCK)
    in_row = offsets < cols
    dtype = x_ptr.dtype.element_ty
    own = tl.load(buffer_table_ptr + RANK).to(tl.pointer_type(dtype))
    for row in range(program, rows, programs):
        tl.store(own + row * cols + offsets, tl.load(x_ptr + row * cols + offsets, mask=in_row), mask=in_row)
    epoch = tl.load(epochs_ptr + program) + 1
    _meet(signal_table_ptr, program, epoch, RANK, WORLD)
    for row in range(program, rows, programs):
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            peer = tl.load(buffer_table_ptr + r).to(tl.pointer_type(dtype))
            total += tl.load(peer + row * cols + offsets, mask=in_row, other=0.0).to(tl.float32)
        reduced = total.to(dtype)
        if NORM:
            # As the reference: the residual added in the model dtype, the norm in float32,
            # rounded back before the weight multiply.
            hidden = (reduced + tl.load(residual_ptr + row * cols + offsets, mask=in_row, other=0.0)).to(dtype)
            tl.store(residual_out_ptr + row * cols + offsets, hidden, mask=in_row)
            h = hidden.to(tl.float32)
            scale = tl.rsqrt(tl.sum(h * h, axis=0) / cols + eps)
            weight = tl.load(weight_ptr + offsets, mask=in_row, other=0.0)
            reduced = (weight * (h * scale).to(dtype)).to(dtype)
        tl.store(x_ptr + row * cols + offsets, reduced, mask=in_row)
    _meet(signal_table_ptr, program, epoch + 1, RANK, WORLD)
    tl.store(epochs_ptr + program, epoch + 1)


def one_shot_all_reduce(x: torch.Tensor, peers, residual: torch.Tensor | None = None,
                        weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    rows, cols = x.shape
    if x.numel() * x.element_size() > peers.buffers[peers.rank].numel():
        raise ValueError(f"{x.numel() * x.element_size()} bytes do not fit the {peers.buffers[peers.rank].numel()}-byte "
                         "all-reduce buffer")
    residual_out = None if residual is None else torch.empty_like(residual)
    if rows:
        _one_shot_all_reduce_kernel[(min(rows, MAX_PROGRAMS),)](
            x, peers.buffer_table, peers.signal_table, peers.epochs, x if residual is None else residual,
            x if residual_out is None else residual_out, x if weight is None else weight, rows, cols, eps,
            RANK=peers.rank, WORLD=len(peers.buffers), NORM=residual is not None, BLOCK=triton.next_power_of_2(cols),
            num_warps=8 if cols >= 4096 else 4)
    return x if residual is None else (x, residual_out)
