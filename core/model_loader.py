"""Reading checkpoints (safetensors only) and copying them into a model's parameters."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import torch
from safetensors import safe_open
from torch import nn

from hookllm.layers.linear import MergedLinear

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@contextlib.contextmanager
def building_on(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Create modules' parameters directly on the target device and dtype (no CPU fp32 copy).

    Buffers created with an explicit dtype (rotary tables) keep it.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: one file, or the shards its index names."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = [p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles:
        raise ValueError(
            f"{model_dir} holds only pickle checkpoints ({', '.join(pickles)}); hookllm loads "
            "safetensors only, since unpickling can run arbitrary code. Convert with "
            "`model.save_pretrained(dir, safe_serialization=True)`."
        )
    raise ValueError(f"no *.safetensors checkpoint found in {model_dir}")


def iterate_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint, one file open at a time."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights_into(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: Sequence[tuple[str, str, str]] = (),
    skip: Callable[[str], bool] = lambda name: False,
) -> None:
    """Copy checkpoint tensors into ``model``'s parameters by name; fail on any mismatch.

    ``stacked`` maps checkpoint names onto fused parameters: ``(".qkv_proj", ".q_proj", "q")``
    sends ``...q_proj.weight`` to shard ``"q"`` of ``...qkv_proj.weight``. ``skip`` names
    checkpoint tensors to ignore (e.g. a saved copy of a tied lm_head). Raises ``ValueError``
    naming every unexpected checkpoint tensor and every parameter left unloaded.
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    expected: set[tuple[str, str | None]] = set()
    for name in params:
        owner = modules.get(name.rsplit(".", 1)[0])
        if isinstance(owner, MergedLinear):
            expected.update((name, shard) for shard in owner.shard_offsets)
        else:
            expected.add((name, None))
    loaded: set[tuple[str, str | None]] = set()
    unexpected: list[str] = []
    for ckpt_name, tensor in weights:
        if skip(ckpt_name):
            continue
        name, shard = ckpt_name, None
        for fused, part, shard_id in stacked:
            if part + "." in ckpt_name:
                name, shard = ckpt_name.replace(part + ".", fused + "."), shard_id
                break
        param = params.get(name)
        if param is None or (name, shard) not in expected:
            unexpected.append(ckpt_name)
            continue
        with torch.no_grad():
            if shard is None:
                if param.shape != tensor.shape:
                    raise ValueError(
                        f"checkpoint tensor {ckpt_name} has shape {tuple(tensor.shape)}, "
                        f"model expects {tuple(param.shape)}"
                    )
                param.data.copy_(tensor)
            else:
                modules[name.rsplit(".", 1)[0]].load_shard(param, shard, tensor)
        loaded.add((name, shard))
    missing = sorted(f"{n} [{s}]" if s else n for n, s in expected - loaded)
    problems = []
    if missing:
        problems.append("missing tensors: " + ", ".join(missing))
    if unexpected:
        problems.append("unexpected tensors: " + ", ".join(sorted(unexpected)))
    if problems:
        raise ValueError(f"checkpoint does not match {type(model).__name__}: " + "; ".join(problems))
