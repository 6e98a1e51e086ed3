"""A PEFT LoRA adapter read from its folder and checked against the base model.

PEFT saves ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``, ``target_modules``,
per-module ``rank_pattern`` / ``alpha_pattern``) and ``adapter_model.safetensors``, whose tensors
are named ``base_model.model.<module>.lora_A.weight`` ([r, in]) and ``...lora_B.weight`` ([out, r])
(an embedding's ``...lora_embedding_A`` [r, vocab] and ``...lora_embedding_B`` [hidden, r]).
A module's delta is ``x A^T B^T * scaling``, ``scaling = alpha / r`` (``alpha / sqrt(r)`` with
rsLoRA), ``r`` and ``alpha`` the module's own (its pattern's, else the adapter's). The scaling is
folded into B here, once, so the kernels only multiply and add.

Every check names the adapter and the problem: a rank over ``max_lora_rank``, a target module
the base model does not have (or that hookllm cannot adapt), a tensor whose shape does not match
the base model's, a different base model, or a PEFT feature hookllm does not serve (DoRA, trained
biases, ``modules_to_save``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from hookllm.config import text_config_of
from hookllm.lora.request import LoRARequest

# The projections an adapter may target, by PEFT's module name: (block, checkpoint projection).
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_MODULE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")
_TENSOR = re.compile(r"^base_model\.model\.(.+)\.lora_(?:embedding_(A|B)|(A|B)\.weight)$")


@dataclass
class LoRAAdapter:
    """An adapter's weights on the host: per module name (``model.layers.3.self_attn.q_proj``),
    A ``[r, in]`` and B ``[out, r]`` with the scaling folded in, in the dtype asked for."""

    request: LoRARequest
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def max_rank(self) -> int:
        return max(a.shape[0] for a, _ in self.weights.values())


def target_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(in, out) of every module a LoRA adapter may target in the base model, by the module name
    PEFT gives it (the embedding's "in" is the vocabulary). An MoE model's feed-forward blocks are
    experts, which take no adapter."""
    config = text_config_of(hf_config)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    hidden = config.hidden_size
    per_layer = {"self_attn.q_proj": (hidden, heads * head_dim), "self_attn.k_proj": (hidden, kv_heads * head_dim),
                 "self_attn.v_proj": (hidden, kv_heads * head_dim), "self_attn.o_proj": (heads * head_dim, hidden)}
    if not is_moe(config):
        inter = config.intermediate_size
        per_layer |= {"mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
                      "mlp.down_proj": (inter, hidden)}
    vocab = {"model.embed_tokens": (config.vocab_size, hidden), "lm_head": (hidden, config.vocab_size)}
    return vocab | {f"model.layers.{i}.{name}": shape
                    for i in range(config.num_hidden_layers) for name, shape in per_layer.items()}


def is_moe(text_config: Any) -> bool:
    return any((getattr(text_config, name, 0) or 0) > 0 for name in ("num_experts", "num_local_experts"))


def read_adapter_config(request: LoRARequest) -> dict[str, Any]:
    """The adapter's ``adapter_config.json``, with the PEFT features hookllm does not serve refused."""
    name, folder = request.lora_name, Path(request.lora_path)
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {path} not found (a PEFT adapter folder holds adapter_config.json "
                         "and adapter_model.safetensors)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"LoRA adapter {name!r}: {path} is not readable JSON: {exc}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {config['peft_type']!r} is not LORA")
    refused = {"use_dora": "DoRA (use_dora) is not supported", "modules_to_save": "modules_to_save (fully "
               "trained modules beside the LoRA weights) is not supported", "fan_in_fan_out": "fan_in_fan_out "
               "(Conv1D weights) is not supported"}
    for key, problem in refused.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {problem}")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: bias={config['bias']!r}: trained biases are not supported")
    return config


def check_base_model(request: LoRARequest, config: dict[str, Any], served: list[str]) -> None:
    """The adapter's base model (PEFT's ``base_model_name_or_path``, or the request's
    ``base_model_name``) must be one of ``served``'s names: compared by the last path component,
    case-insensitively, so a hub id and a local copy named after it agree (a hub cache's snapshot
    folder, ``models--Org--Name/snapshots/<revision>``, is named ``Name``)."""
    def key(name: str) -> str:
        cached = re.search(r"models--[^/]+--([^/]+)/snapshots/", name)
        return (cached.group(1) if cached else name.rstrip("/").rsplit("/", 1)[-1]).lower()

    names = {key(s) for s in served if s}
    for claimed in (request.base_model_name, config.get("base_model_name_or_path")):
        if claimed and key(claimed) not in names:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: it was trained for base model {claimed!r}, "
                             f"but this engine serves {served[0]!r}")


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's per-module override: the first pattern matching the module name's end."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def load_adapter(request: LoRARequest, hf_config: Any, max_lora_rank: int, dtype: torch.dtype,
                 served_names: list[str] | None) -> LoRAAdapter:
    """Read and check the adapter at ``request.lora_path`` against the base model's config (and
    its base model against ``served_names``, unless None: checked once already); ``ValueError``
    naming the adapter and the problem."""
    name = request.lora_name
    config = read_adapter_config(request)
    if served_names is not None:
        check_base_model(request, config, served_names)
    path = Path(request.lora_path) / "adapter_model.safetensors"
    if not path.is_file():
        pickled = Path(request.lora_path) / "adapter_model.bin"
        hint = " (adapter_model.bin is a pickle: save it as safetensors)" if pickled.exists() else ""
        raise ValueError(f"LoRA adapter {name!r}: {path} not found{hint}")
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - a corrupt file is the adapter's problem, named as such
        raise ValueError(f"LoRA adapter {name!r}: {path} is not a readable safetensors file: {exc}") from None
    shapes = target_shapes(hf_config)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _TENSOR.match(tensor_name)
        if tensor_name.endswith(".base_layer.weight"):
            raise ValueError(f"LoRA adapter {name!r}: it saves the whole {tensor_name[:-len('.base_layer.weight')]!r} "
                             "(PEFT's save_embedding_layers), which hookllm does not serve: a resized or trained "
                             "vocabulary is not supported; save the adapter with save_embedding_layers=False")
        if match is None:
            raise ValueError(f"LoRA adapter {name!r}: tensor {tensor_name!r} is not a LoRA A or B weight")
        module, embedding_kind, kind = match.groups()
        kind = embedding_kind or kind
        if module not in shapes:
            raise ValueError(f"LoRA adapter {name!r}: target module {module!r} " + _why_not_target(module, hf_config))
        pairs.setdefault(module, {})[kind] = tensor
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r}: {path} holds no LoRA weights")
    weights = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: module {module!r} has lora_{set(pair).pop()} but not its "
                             f"partner")
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        in_size, out_size = shapes[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape != (rank, in_size) or b.shape != (out_size, rank):
            raise ValueError(f"LoRA adapter {name!r}: module {module!r} has lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}; the base model needs [r, {in_size}] and [{out_size}, r]")
        if rank > max_lora_rank:
            raise ValueError(f"LoRA adapter {name!r}: module {module!r} has rank {rank}, over max_lora_rank "
                             f"{max_lora_rank} (raise --max-lora-rank)")
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        weights[module] = (a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous())
    return LoRAAdapter(request, weights)


def _why_not_target(module: str, hf_config: Any) -> str:
    match = _MODULE.match(module)
    config = text_config_of(hf_config)
    if match is None:
        return ("is not one hookllm can adapt (the decoder layers' q/k/v/o and gate/up/down projections, "
                "model.embed_tokens and lm_head)")
    layer, block, projection = int(match.group(1)), match.group(2), match.group(3)
    if layer >= config.num_hidden_layers:
        return f"is in layer {layer}, but the base model has {config.num_hidden_layers} layers"
    if block == "mlp" and is_moe(config):
        return "is an MoE model's feed-forward block: adapters on experts are not supported (target attention)"
    return f"is not a projection of the base model (targets: {', '.join(ATTENTION_PROJECTIONS + MLP_PROJECTIONS)})"
