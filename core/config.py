"""Engine and model configuration, resolved once when an engine starts."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
LOAD_FORMATS = ("auto", "safetensors", "dummy")


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" is the current GPU if there is one, else the CPU; a bare "cuda" gets its index."""
    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto" is bf16 on a GPU and fp32 on the CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_hf_config(path: str | Path) -> Any:
    """The checkpoint's config: a transformers config when transformers knows the model type."""
    from transformers import AutoConfig, PretrainedConfig

    config_file = Path(path) / "config.json"
    if not config_file.exists():
        raise ValueError(f"{path} is not a model folder: it has no config.json")
    try:
        return AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError):
        # A model type transformers doesn't know (a third-party plugin's): keep the raw fields.
        return PretrainedConfig.from_dict(json.loads(config_file.read_text()))


def text_config_of(hf_config: Any) -> Any:
    """The decoder's config (a multimodal config nests it as ``text_config``)."""
    return getattr(hf_config, "text_config", None) or hf_config


@dataclass
class ModelConfig:
    path: str
    hf_config: Any
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    plugin: str | None = None  # the plugin whose registered class serves ``architecture``

    @classmethod
    def from_path(cls, path: str, dtype: torch.dtype, max_model_len: int | None) -> "ModelConfig":
        hf_config = load_hf_config(path)
        architectures = getattr(hf_config, "architectures", None) or []
        if not architectures:
            raise ValueError(f"{path}/config.json names no architectures")
        text = text_config_of(hf_config)
        limit = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
        if max_model_len is None:
            max_model_len = limit or 2048
        elif limit and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's {limit} positions")
        return cls(str(path), hf_config, architectures[0], dtype, int(max_model_len))


@dataclass
class EngineConfig:
    """Everything an engine (and a worker started elsewhere) needs to rebuild the same setup."""

    model: str
    plugins: list[str] = field(default_factory=list)
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 30
    attention_backend: str = "auto"
    enforce_eager: bool = False  # CUDA only: no CUDA graphs for decode steps
    max_cuda_graph_batch_size: int = 512
    # Schedule step n+1 while the device runs step n (outputs lag one step). None: on for CUDA.
    async_scheduling: bool | None = None
    seed: int = 0
    tokenizer: str | None = None
    # Ranks (one process and GPU each) the model's layers are split across; 1: no torch.distributed.
    tensor_parallel_size: int = 1
    # "auto" / "safetensors": read the checkpoint; "dummy": random weights, no file read (benchmarks).
    load_format: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
