"""Building a transformers model without initializing it, and copying a checkpoint into it.

The model is built with its parameters on the meta device (no memory, no random init) and its
buffers computed for real (RoPE tables, embedding scales), then each parameter gets
uninitialized storage on the target device, in the model's dtype (float32 where transformers
keeps modules in float32), and is filled from the tensors hookllm's loader reads.

Checkpoint names map onto parameter names as transformers maps them: most are equal; its
conversion mapping (``transformers.conversion_mapping``, the same functions in 5.17 and 5.24)
renames legacy names and fuses per-expert MoE tensors into the stacked parameters transformers 5
modules hold.

Under tensor parallelism the loader hands over lazy safetensors slices: a parameter split over
the ranks (:mod:`.parallel`: it carries a ``weight_loader``) reads only its part of one;
anything else, the tensors transformers' conversions combine included, is read whole.
"""

from __future__ import annotations

import copy
import math
import re
from typing import Any, Iterable

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

from hookllm.adapters.transformers.attention import IMPLEMENTATION
from hookllm.layers import on_other_stage
from hookllm.layers.linear import LoadedWeight, loaded_shape
from hookllm.layers.linear import materialize as read_whole

# Buffers older checkpoints saved that transformers now computes (it skips them the same way).
COMPUTED_BUFFERS = re.compile(r"rotary_emb\.inv_freq$|(^|\.)position_ids$")


def build_empty(model_cls: type, config: Any, dtype: torch.dtype) -> nn.Module:
    """``model_cls`` built from ``config`` with hookllm's attention: parameters on the meta
    device, buffers real on the current default device (``building_on`` sets it)."""
    with init_empty_weights(include_buffers=False):
        model = model_cls._from_config(config, attn_implementation=IMPLEMENTATION, dtype=dtype)
    return model.eval().requires_grad_(False)


def materialize(model: nn.Module, dtype: torch.dtype) -> None:
    """Give every meta parameter uninitialized storage on the current default device, in its
    built dtype or float32 where transformers keeps it so, then tie the tied weights. What a
    parameter carries (a split parameter's loader) stays with it."""
    keep_fp32 = _fp32_pattern(model, dtype)
    new: dict[int, nn.Parameter] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is None or not param.is_meta:
                continue
            full_name = f"{path}.{name}" if path else name
            if id(param) not in new:
                fp32 = keep_fp32 is not None and keep_fp32.search(full_name)
                storage = torch.empty(param.shape, dtype=torch.float32 if fp32 else param.dtype)
                new[id(param)] = nn.Parameter(storage, requires_grad=False)
                new[id(param)].__dict__.update(param.__dict__)
            module._parameters[name] = new[id(param)]
    model.tie_weights()


def _fp32_pattern(model: nn.Module, dtype: torch.dtype) -> re.Pattern | None:
    """transformers' rule: ``_keep_in_fp32_modules_strict`` stay float32 under fp16 and bf16,
    ``_keep_in_fp32_modules`` under fp16 only (names searched in parameter names)."""
    names: set[str] = set()
    if dtype in (torch.float16, torch.bfloat16):
        names |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        names |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if not names:
        return None
    return re.compile("|".join(name.replace(".", r"\.").replace("*", ".*") for name in sorted(names)))


def load_checkpoint_tensors(model: nn.Module, weights: Iterable[tuple[str, LoadedWeight]]) -> None:
    """Copy ``(checkpoint name, tensor or lazy safetensors slice)`` pairs into ``model``'s
    (materialized) parameters and persistent buffers, converting names and tensors the way
    transformers does.

    A tied weight (``lm_head`` tied to the embedding) is loaded from whichever name the
    checkpoint holds. ``ValueError`` naming the first missing parameter and the first unexpected
    tensor (and how many more of each) when the checkpoint does not match.
    """
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    converter_of = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    targets = model.state_dict(keep_vars=True)  # tied weights appear under each name
    canonical = set(dict(model.named_parameters())) | {name for name, _ in model.named_buffers() if name in targets}
    ignore = _ignore_pattern(model, "_keys_to_ignore_on_load_unexpected")
    buffers = {name for name, _ in model.named_buffers()}
    loaded: set[int] = set()
    aliases: list[tuple[str, torch.Tensor]] = []
    fused: dict[str, list[tuple[str, str, torch.Tensor]]] = {}
    unexpected: list[str] = []

    def fuse(name: str) -> None:
        """Convert the checkpoint tensors gathered for ``name`` into the parameters they make."""
        parts = fused.pop(name)
        converter = copy.deepcopy(converter_of[parts[0][1]])
        # Per-expert tensors stack in expert order: experts.2 before experts.10.
        for ckpt_name, pattern, tensor in sorted(parts, key=lambda part: dot_natural_key(part[0])):
            converter.add_tensor(name, ckpt_name, pattern, tensor)
        for target, value in converter.convert(name, model=model, config=model.config).items():
            value = value[0] if isinstance(value, list) else value
            if target not in targets:
                unexpected.append(target)
            else:
                _copy(targets[target], value, target, loaded)

    for ckpt_name, tensor in weights:
        name, pattern = rename_source_key(ckpt_name, renamings, converters, model.base_model_prefix, targets)
        if name not in targets and ckpt_name in targets:
            name, pattern = ckpt_name, None
        if name not in targets:
            # Buffers transformers computes, names the model says to ignore and other pipeline
            # stages' parts are skipped.
            skipped = (ckpt_name in buffers or COMPUTED_BUFFERS.search(ckpt_name) or ignore and ignore.search(ckpt_name)
                       or on_other_stage(model, name))
            if not skipped:
                unexpected.append(ckpt_name)
        elif pattern is not None:
            target = targets[name]
            whole = read_whole(tensor).to(target.device, target.dtype)
            fused.setdefault(name, []).append((ckpt_name, pattern, whole))
            # Conversions stack, concatenate, split or transpose: they keep the element count, so
            # a group is whole once it holds its parameter's checkpoint count (a split parameter
            # holds less); fusing it then bounds the memory held to one group (one layer's
            # experts), not every expert of the model.
            if sum(part[2].numel() for part in fused[name]) >= math.prod(_checkpoint_shape(target)):
                fuse(name)
        elif name not in canonical:
            aliases.append((name, read_whole(tensor)))  # a lazy slice is readable only while its file is open
        else:
            _copy(targets[name], tensor, ckpt_name, loaded)
    for name in list(fused):
        fuse(name)  # an incomplete group: its conversion or copy says what is wrong
    for name, tensor in aliases:
        if id(targets[name]) not in loaded:
            _copy(targets[name], tensor, name, loaded)
    ignored_missing = _ignore_pattern(model, "_keys_to_ignore_on_load_missing")
    missing = sorted(name for name, param in model.named_parameters()
                     if id(param) not in loaded and not (ignored_missing and ignored_missing.search(name)))
    problems = [f"{what} {names[0]}" + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")
                for what, names in (("missing tensor", missing), ("unexpected tensor", sorted(unexpected))) if names]
    if problems:
        raise ValueError(f"checkpoint does not match {type(model).__name__}: " + "; ".join(problems))


def _copy(target: torch.Tensor, tensor: LoadedWeight, ckpt_name: str, loaded: set[int]) -> None:
    """Fill ``target`` from a whole tensor or lazy slice: through its ``weight_loader`` (its part
    only) where it is split over tensor-parallel ranks, else whole."""
    weight_loader = getattr(target, "weight_loader", None)
    with torch.no_grad():
        if weight_loader is not None:
            try:
                weight_loader(target, tensor)
            except ValueError as exc:
                raise ValueError(f"checkpoint tensor {ckpt_name}: {exc}") from exc
        elif tuple(target.shape) != loaded_shape(tensor):
            raise ValueError(f"checkpoint tensor {ckpt_name} has shape {loaded_shape(tensor)}, "
                             f"the model expects {tuple(target.shape)}")
        else:
            target.copy_(read_whole(tensor))
    loaded.add(id(target))


def _checkpoint_shape(target: torch.Tensor) -> tuple[int, ...]:
    """``target``'s shape in the checkpoint: whole, where it is split over tensor-parallel ranks."""
    return getattr(target, "checkpoint_shape", tuple(target.shape))


def _ignore_pattern(model: nn.Module, attribute: str) -> re.Pattern | None:
    """The model's regexes of names to ignore when loading (``_keys_to_ignore_on_load_*``)."""
    patterns = sorted(getattr(model, attribute, None) or ())
    return re.compile("|".join(f"({p})" for p in patterns)) if patterns else None
