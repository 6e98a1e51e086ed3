"""Reading checkpoints (safetensors only) and copying them into a model's parameters.

Two ways to read: `iterate_weights` yields whole tensors (any adapter);
`iterate_weight_slices` yields lazy safetensors slices, so a tensor-parallel layer's
``weight_loader`` reads only its rank's rows or columns. `load_checkpoint` picks between them
and ``load_format="dummy"`` (random weights, no file read). `construct_model` builds a
registered class, a multimodal one around its registered text decoder.
"""

from __future__ import annotations

import contextlib
import json
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from safetensors import safe_open
from torch import nn

from hookllm.config import LOAD_FORMATS
from hookllm.layers.linear import LoadedWeight, loaded_shape, materialize
from hookllm.layers.norm import RMSNorm
from hookllm.plugins.contract import capability, is_multimodal
from hookllm.plugins.quantization import QuantizationMethod, finish_loading
from hookllm.plugins.registry import ModelRegistry

DUMMY_STD = 0.02

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


def text_architecture(text_config: Any) -> str:
    """A multimodal checkpoint's decoder architecture: from its config, else transformers'
    causal-LM class for its model_type."""
    architectures = getattr(text_config, "architectures", None)
    if architectures:
        return architectures[0]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(text_config, "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"cannot tell the text decoder's architecture (text_config model_type {model_type!r})")
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def construct_model(model_cls: type, hf_config: Any, registry: ModelRegistry, selected: Iterable[str]) -> nn.Module:
    """``model_cls(hf_config)``; for a multimodal class (``hookllm.plugins.contract.SupportsMultiModal``)
    ``model_cls(hf_config, text_model_cls)``, the decoder's class chosen by the same rule as a
    checkpoint's (a ``selected`` plugin wins a conflict). Builds on the current default device."""
    if not is_multimodal(model_cls):
        return model_cls(hf_config)
    text_arch = text_architecture(hf_config.text_config)
    return model_cls(hf_config, registry.resolve(text_arch, registry.owner(text_arch, selected)))


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


def load_tensor(model_dir: str | Path, name: str) -> torch.Tensor:
    """One tensor of the checkpoint, by name; ``ValueError`` if no file has it."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise ValueError(f"{model_dir}: the checkpoint has no tensor {name!r}")


def iterate_weight_slices(model_dir: str | Path) -> Iterator[tuple[str, Any]]:
    """Yield (name, lazy slice) for every tensor: ``safe_open(...).get_slice(name)`` objects
    whose ``[a:b]`` / ``[:, a:b]`` indexing reads only those elements, and ``get_shape()`` none.

    A slice is valid until the next item is requested (its file is then closed at the end).
    """
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def initialize_dummy_weights(model: nn.Module, seed: int = 0, std: float = DUMMY_STD) -> None:
    """Fill every parameter in place without reading a file: norm weights (``RMSNorm``,
    ``LayerNorm``) 1 and LayerNorm biases 0, everything else normal(0, ``std``).

    Each parameter's generator is seeded from ``seed`` and its name, so every rank draws the
    same values for replicated parameters (and the run is reproducible).
    """
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, param in model.named_parameters():
            owner = modules[name.rpartition(".")[0]]
            if isinstance(owner, (RMSNorm, nn.LayerNorm)):
                param.fill_(1.0 if name.endswith("weight") else 0.0)
                continue
            generator = torch.Generator(param.device).manual_seed(seed + zlib.crc32(name.encode()))
            if param.dtype.itemsize == 1:  # quantized (no random kernels): drawn in float32
                param.copy_(torch.empty(param.shape, device=param.device).normal_(0.0, std, generator=generator))
            else:
                param.normal_(0.0, std, generator=generator)


def load_checkpoint(model: nn.Module, model_dir: str | Path, load_format: str = "auto",
                    quantization: QuantizationMethod | None = None, name_prefix: str = "",
                    exclude: Sequence[str] = ()) -> None:
    """Load ``model``'s weights the way ``load_format`` says.

    ``"auto"`` / ``"safetensors"``: ``model.load_weights`` gets lazy slices
    (`iterate_weight_slices`) when the class sets ``supports_tensor_parallel = True`` (its
    loader must accept them, as `load_weights_into` does), else whole tensors
    (`iterate_weights`); through ``quantization.checkpoint_tensors`` when the model is
    quantized. ``"dummy"``: `initialize_dummy_weights`, no file is opened. Quantized layers then
    finish their weights (``process_weights_after_loading``). ``name_prefix`` goes before every
    tensor's name; the tensors named in ``exclude`` are not the model's (a pooler's head).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if load_format == "dummy":
        initialize_dummy_weights(model)
    else:
        lazy = capability(model, "supports_tensor_parallel")
        weights = iterate_weight_slices(model_dir) if lazy else iterate_weights(model_dir)
        if name_prefix or exclude:
            weights = ((name_prefix + name, tensor) for name, tensor in weights if name not in exclude)
        if quantization is not None:
            weights = quantization.checkpoint_tensors(weights, model)
        model.load_weights(weights)
    finish_loading(model)


def load_weights_into(
    model: nn.Module,
    weights: Iterable[tuple[str, LoadedWeight]],
    stacked: Sequence[tuple[str, str, str]] = (),
    skip: Callable[[str], bool] = lambda name: False,
    rename: Callable[[str], tuple[str, str | None] | None] = lambda name: None,
) -> None:
    """Copy checkpoint tensors into ``model``'s parameters by name; fail on any mismatch.

    ``weights`` holds whole tensors or lazy safetensors slices. A parameter whose module has a
    ``weight_loader`` (the tensor-parallel layers) is handed to it, with the shard name for a
    fused one, and it copies this rank's part; any other parameter receives the whole tensor.
    ``stacked`` maps checkpoint names onto fused parameters: ``(".qkv_proj", ".q_proj", "q")``
    sends ``...q_proj.weight`` to shard ``"q"`` of ``...qkv_proj.weight``. ``skip`` names
    checkpoint tensors to ignore (e.g. a saved copy of a tied lm_head). ``rename`` maps a
    checkpoint name onto ``(parameter, shard)``, or None to use the rules above (per-expert
    tensors onto stacked experts: :func:`hookllm.layers.fused_moe.expert_tensor_renamer`).

    A module with ``expected_shards(param_name)`` (``FusedMoE``) lists the shards each of its
    parameters needs, and its ``weight_loader`` returns the shards a tensor filled (a stacked
    tensor fills all of them; a tensor of an expert another rank holds fills none of this
    rank's). Raises ``ValueError`` naming every unexpected checkpoint tensor and every
    parameter (or shard) left unloaded.
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    expected: set[tuple[str, str | None]] = set()
    for name in params:
        owner_name, _, local_name = name.rpartition(".")
        owner = modules.get(owner_name)
        if hasattr(owner, "expected_shards"):
            expected.update((name, shard) for shard in owner.expected_shards(local_name))
        elif hasattr(owner, "shard_offsets"):
            expected.update((name, shard) for shard in owner.shard_offsets)
        else:
            expected.add((name, None))
    loaded: set[tuple[str, str | None]] = set()
    unexpected: list[str] = []
    for ckpt_name, tensor in weights:
        if skip(ckpt_name):
            continue
        name, shard = rename(ckpt_name) or (ckpt_name, None)
        for fused, part, shard_id in stacked:
            if shard is None and part + "." in name:
                name, shard = name.replace(part + ".", fused + "."), shard_id
                break
        param = params.get(name)
        owner = modules.get(name.rpartition(".")[0])
        reports_shards = hasattr(owner, "expected_shards")
        if param is None or (not reports_shards and (name, shard) not in expected):
            unexpected.append(ckpt_name)
            continue
        weight_loader = getattr(owner, "weight_loader", None)
        with torch.no_grad():
            if weight_loader is not None:
                args = (param, tensor) if shard is None else (param, tensor, shard)
                try:
                    filled = weight_loader(*args)
                except ValueError as exc:
                    raise ValueError(f"checkpoint tensor {ckpt_name}: {exc}") from exc
                if reports_shards:
                    loaded.update((name, s) for s in filled)
                    continue
            else:
                if tuple(param.shape) != loaded_shape(tensor):
                    raise ValueError(
                        f"checkpoint tensor {ckpt_name} has shape {loaded_shape(tensor)}, "
                        f"model expects {tuple(param.shape)}"
                    )
                param.data.copy_(materialize(tensor))
        loaded.add((name, shard))
    missing = sorted(f"{n} [{s}]" if s else n for n, s in expected - loaded)
    problems = []
    if missing:
        problems.append("missing tensors: " + ", ".join(missing))
    if unexpected:
        problems.append("unexpected tensors: " + ", ".join(sorted(unexpected)))
    if problems:
        raise ValueError(f"checkpoint does not match {type(model).__name__}: " + "; ".join(problems))
