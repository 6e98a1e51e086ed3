"""Helpers of the tensor-parallel tests: run a function on gloo ranks in spawned processes, build
a model from a checkpoint, and run prompts through the paged attention path without an engine."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from hookllm.config import load_hf_config
from hookllm.distributed import cleanup_dist_env_and_memory, init_tensor_parallel
from hookllm.worker.forward_context import AttentionMetadata, set_forward_context
from hookllm.kernels import get_attention_backend
from hookllm.layers import Attention
from hookllm.utils import process_context
from hookllm.worker.model_loader import building_on, load_checkpoint

HIDDEN, INTERMEDIATE, HEADS = 64, 128, 4
COMMON = dict(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=2,
              num_attention_heads=HEADS, max_position_embeddings=256)
CASES = {
    # GQA with every bias (random, so the row-parallel "bias added once" shows).
    "llama-gqa-bias": lambda: LlamaConfig(**COMMON, vocab_size=320, num_key_value_heads=2,
                                          attention_bias=True, mlp_bias=True),
    # Tied embeddings, qkv bias, and a vocabulary that does not split evenly (padded to 302).
    "qwen2-tied-odd-vocab": lambda: Qwen2Config(**COMMON, vocab_size=301, num_key_value_heads=2,
                                                tie_word_embeddings=True),
    # One KV head for two ranks: replicated; q/k norm.
    "qwen3-one-kv-head": lambda: Qwen3Config(**COMMON, vocab_size=320, num_key_value_heads=1, head_dim=32),
}

BLOCK_SIZE = 16
# Each prompt runs in two steps: all but its last TAIL tokens, then those reading the cache.
TAIL = 2


def run_ranks(fn: Callable[..., None], world_size: int, args: tuple, timeout_s: float = 240.0) -> None:
    """Run ``fn(rank, *args)`` in ``world_size`` processes, started as the engine starts its ranks;
    re-raise a rank's error and fail (terminating the ranks) if they are not all done within ``timeout_s``."""
    start_method = process_context().get_start_method()
    context = mp.start_processes(fn, args=args, nprocs=world_size, join=False, start_method=start_method)
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"tensor-parallel ranks still running after {timeout_s:.0f}s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
                process.join(5)


def randomize_biases(path: Path, seed: int = 0) -> None:
    """transformers initialises biases to zero; random ones make "bias added once" observable."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        if name.endswith(".bias"):
            tensors[name] = torch.randn(tensor.shape, generator=generator) * 0.2
    save_file(tensors, str(file), metadata={"format": "pt"})


def build_model(path: Path, load_format: str = "auto") -> torch.nn.Module:
    """The Llama adapter's class for the checkpoint, built in fp32 on the CPU and loaded."""
    from hookllm.adapters.llama import model as llama

    hf_config = load_hf_config(path)
    with building_on(torch.device("cpu"), torch.float32):
        model = getattr(llama, hf_config.architectures[0])(hf_config)
    load_checkpoint(model, path, load_format)
    return model.eval()


def paged_logits(model: torch.nn.Module, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Logits at every prompt position, prompts concatenated: ``[sum(len), vocab]``.

    The prompts run as one batch in two steps (a prefill of all but the last ``TAIL`` tokens,
    then those, attending to the cached K/V), through the torch paged attention backend.
    """
    lengths = [len(p) for p in prompts]
    blocks = [-(-n // BLOCK_SIZE) for n in lengths]
    table = torch.zeros(len(prompts), max(blocks), dtype=torch.int32)
    first = 0
    for i, n in enumerate(blocks):
        table[i, :n] = torch.arange(first, first + n)
        first += n
    for layer in (m for m in model.modules() if isinstance(m, Attention)):
        shape = (first, BLOCK_SIZE, layer.num_kv_heads, layer.head_dim)
        layer.k_cache, layer.v_cache = torch.zeros(shape), torch.zeros(shape)
    backend = get_attention_backend("torch")
    per_prompt: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in range(2):
        spans = [(0, n - TAIL) if step == 0 else (n - TAIL, n) for n in lengths]
        ids = torch.cat([torch.tensor(p[lo:hi]) for p, (lo, hi) in zip(prompts, spans)])
        positions = torch.cat([torch.arange(lo, hi) for lo, hi in spans])
        rows = torch.cat([torch.full((hi - lo,), i) for i, (lo, hi) in enumerate(spans)])
        counts = torch.tensor([hi - lo for lo, hi in spans])
        metadata = AttentionMetadata(
            slot_mapping=(table[rows, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE,),
            block_tables=(table,),
            seq_lens=torch.tensor([hi for _, hi in spans], dtype=torch.int32),
            query_start_loc=torch.cat([torch.zeros(1), counts.cumsum(0)]).to(torch.int32),
            max_query_len=int(counts.max()), max_seq_len=max(hi for _, hi in spans), backend=backend,
        )
        with torch.inference_mode(), set_forward_context(metadata):
            logits = model.compute_logits(model(ids, positions))
        for i, chunk in enumerate(logits.split(counts.tolist())):
            per_prompt[i].append(chunk)
    return torch.cat([torch.cat(chunks) for chunks in per_prompt])


def tp_worker(rank: int, world_size: int, init_method: str, cases: dict[str, str], prompts: list[list[int]],
              dummy_dir: str, out_dir: str) -> None:
    """One rank: load each case ``world_size``-way, save its logits, parameter shapes and
    layer-0 qkv shard; then the dummy load format on ``dummy_dir`` (a config.json only)."""
    torch.set_num_threads(1)  # the ranks share the machine's cores
    init_tensor_parallel(rank, world_size, "gloo", init_method)
    try:
        results: dict[str, Any] = {}
        for name, path in cases.items():
            model = build_model(Path(path))
            results[name] = {
                "logits": paged_logits(model, prompts),
                "shapes": {n: tuple(p.shape) for n, p in model.named_parameters()},
                "qkv": model.model.layers[0].self_attn.qkv_proj.weight.detach().clone(),
            }
        model = build_model(Path(dummy_dir), load_format="dummy")
        results["dummy"] = {"logits": paged_logits(model, prompts)}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        cleanup_dist_env_and_memory()


# Calls of the one-shot all-reduce test: (rows, cols, dtype, fused with residual + RMSNorm).
ALL_REDUCE_CALLS = [(3, 16, torch.float32, False), (1, 16, torch.bfloat16, False), (5, 24, torch.bfloat16, True),
                    (2, 16, torch.float32, True), (4, 8, torch.float32, False)]


def all_reduce_inputs(rank: int, call: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Call ``call``'s (x, residual, weight) on ``rank``: x differs per rank; residual and weight agree.

    Under the Triton interpreter every call is float32: it rounds float32 to bfloat16 toward
    zero where the GPU rounds to nearest (bfloat16 is checked by the reference and on the GPU)."""
    import os

    rows, cols, dtype, _ = ALL_REDUCE_CALLS[call]
    dtype = torch.float32 if os.environ.get("TRITON_INTERPRET") == "1" else dtype
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(100 * call + rank)).to(dtype)
    shared = torch.Generator().manual_seed(999 + call)
    return x, torch.randn(rows, cols, generator=shared).to(dtype), (1 + torch.randn(cols, generator=shared)).to(dtype)


def custom_all_reduce_worker(rank: int, world_size: int, init_method: str, out_dir: str) -> None:
    """One rank: every ``ALL_REDUCE_CALLS`` call through ``CustomAllReduce`` (the Triton kernel
    under ``TRITON_INTERPRET=1``, else the torch reference) and through gloo's all_reduce (then
    the reference norm)."""
    import torch.distributed as dist

    from hookllm.distributed.custom_all_reduce import CustomAllReduce
    from hookllm.kernels import reference

    torch.set_num_threads(1)
    init_tensor_parallel(rank, world_size, "gloo", init_method)
    try:
        custom = CustomAllReduce(torch.device("cpu"), max_bytes=4096)
        results = []
        for call, (_, _, _, fused) in enumerate(ALL_REDUCE_CALLS):
            x, residual, weight = all_reduce_inputs(rank, call)
            expected = x.clone()
            dist.all_reduce(expected)
            if fused:
                expected = reference.rms_norm(expected, weight, 1e-6, residual.clone())
                got = custom.all_reduce_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
            else:
                got = custom.all_reduce(x.clone())
            results.append((got, expected))
        torch.save({"results": results, "epochs": custom.peers.epochs.clone()}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        cleanup_dist_env_and_memory()


def custom_all_reduce_gpu_worker(rank: int, world_size: int, init_method: str, out_dir: str) -> None:
    """One rank on GPU ``rank % device_count`` (two ranks share one GPU where there is one):
    eager calls of the one-shot all-reduce at a model's sizes, then the same calls captured in a
    CUDA graph and replayed on new inputs; saves each result beside every rank's inputs."""
    import torch.distributed as dist

    from hookllm.distributed.custom_all_reduce import CustomAllReduce

    init_tensor_parallel(rank, world_size, "gloo", init_method)
    try:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        custom = CustomAllReduce(device)
        shapes = [(1, 4096), (7, 4096), (64, 2048), (3, 8192)]
        weight = torch.rand(shapes[0][1], generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16) + 0.5

        def inputs(seed: int) -> list[torch.Tensor]:
            generator = torch.Generator().manual_seed(seed * world_size + rank)
            return [torch.randn(shape, generator=generator).to(device, torch.bfloat16) for shape in shapes]

        def calls(xs: list[torch.Tensor], residual: torch.Tensor) -> torch.Tensor:
            _, hidden = custom.all_reduce_rms_norm(xs[0], residual, weight, 1e-5)
            for x in xs[1:]:
                custom.all_reduce(x)
            return hidden

        def gathered(xs: list[torch.Tensor]) -> list[torch.Tensor]:
            every = [None] * world_size
            dist.all_gather_object(every, [x.cpu() for x in xs])
            return [torch.stack([ranks[i] for ranks in every]) for i in range(len(xs))]

        records = []
        residual = torch.randn(shapes[0], generator=torch.Generator().manual_seed(7)).to(device, torch.bfloat16)
        eager = inputs(0)
        sent = gathered(eager)
        hidden = calls(eager, residual)
        records.append((sent, residual.cpu(), [x.cpu() for x in eager], hidden.cpu()))
        static = inputs(1)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            hidden = calls(static, residual)
        for replay in range(3):
            for x, fresh in zip(static, inputs(2 + replay)):
                x.copy_(fresh)
            sent = gathered(static)
            graph.replay()
            torch.cuda.synchronize()
            records.append((sent, residual.cpu(), [x.cpu() for x in static], hidden.cpu()))
        torch.save({"records": records, "weight": weight.cpu()}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        cleanup_dist_env_and_memory()


def custom_all_reduce_model_worker(rank: int, world_size: int, init_method: str, checkpoint: str,
                                   prompts: list[list[int]], out_dir: str) -> None:
    """One rank of a model whose row-parallel sums go through the one-shot all-reduce (the torch
    reference on the CPU), left to the norms after them: its logits and where it reduces."""
    from hookllm.distributed import init_custom_all_reduce

    torch.set_num_threads(1)
    init_tensor_parallel(rank, world_size, "gloo", init_method)
    try:
        assert init_custom_all_reduce(torch.device("cpu"), max_bytes=1 << 20)
        model = build_model(Path(checkpoint))
        layers = model.model.layers
        torch.save({"logits": paged_logits(model, prompts),
                    "o_proj_reduces": [layer.self_attn.o_proj.reduce_results for layer in layers],
                    "norms_reduce": [(layer.input_layernorm.reduces_input, layer.post_attention_layernorm.reduces_input)
                                     for layer in layers] + [model.model.norm.reduces_input]},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        cleanup_dist_env_and_memory()


def rank_of(worker: Any, offset: int = 0) -> int:
    """A function for ``collective_rpc``: the calling rank (plus ``offset``, to show arguments arrive)."""
    return torch.distributed.get_rank() + offset if torch.distributed.is_initialized() else offset


def embedding_rows(model: torch.nn.Module) -> int:
    """A function for ``apply_model``: this rank's rows of the input embedding (its vocabulary shard)."""
    return model.model.embed_tokens.weight.shape[0]
