"""What the transformers backend serves, and the one-line reasons it refuses the rest.

It serves decoder-only causal LMs whose transformers implementation routes attention through
transformers' attention interface (so hookllm's paged attention can take its place), with
attention variants hookllm's kernels have: causal, GQA, sliding windows, logit soft-capping and
attention sinks. Anything else is refused with a ``ValueError`` that says why, before or while
the model is built, never answered wrongly.
"""

from __future__ import annotations

import re
from typing import Any

import transformers
from torch import nn
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hookllm.config import is_encoder
from hookllm.plugins.quantization import checkpoint_quant_method

# Layer kinds (config ``layer_types``) the paged kernels serve; the others say why not.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
RECURRENT_LAYER_TYPES = ("linear_attention", "mamba", "conv", "hybrid", "hybrid_sliding")
# RoPE variants whose transformers code picks frequencies from the batch's longest position:
# on a flat batch of several sequences that is another sequence's length (and a host sync).
BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")
# Module classes of state-space, recurrent and token-mixing layers that carry state along a
# sequence: on hookllm's flat batch they would run across sequence boundaries.
RECURRENT_MODULE = re.compile(r"Mamba|SSM|Recurrent|RGLRU|Rwkv|RWKV|GatedDeltaNet|LinearAttention|ShortConv|"
                              r"Lightning|LSTM")


class Unsupported(ValueError):
    """A checkpoint the transformers backend refuses; the message is one line saying why."""


def causal_lm_architectures() -> set[str]:
    """The causal-LM class names of this transformers version (what the backend serves, at most)."""
    names = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return names


def claims(architecture: str) -> bool:
    """Whether the backend takes ``architecture``: any model class transformers implements, so
    that the ones it cannot serve (encoders, state-space models...) are refused with a reason
    instead of "no plugin serves it"."""
    cls = getattr(transformers, architecture, None) if architecture.isidentifier() else None
    return isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)


def is_encoder_architecture(architecture: str) -> bool:
    """Whether transformers' class ``architecture`` is of an encoder (:func:`hookllm.config.is_encoder`)."""
    cls = getattr(transformers, architecture, None) if architecture.isidentifier() else None
    return is_encoder(getattr(cls, "config_class", None))


def model_class(config: Any, encoder: bool = False) -> type:
    """The transformers class of the checkpoint's first architecture, once the config shows a
    decoder-only causal LM (with ``encoder``, an encoder: its base model, a classifier, or a
    masked LM whose head goes unused) the kernels can serve; :class:`Unsupported` otherwise."""
    architecture = (getattr(config, "architectures", None) or [""])[0]
    name = f"{architecture} (model_type {config.model_type!r})"
    if getattr(config, "is_encoder_decoder", False):
        raise Unsupported(f"{name} is an encoder-decoder model; the transformers backend serves decoder-only "
                          "causal LMs and encoders")
    extra_configs = sorted(key for key in getattr(config, "sub_configs", {}) if key != "text_config"
                           and getattr(config, key, None) is not None)
    if extra_configs:
        raise Unsupported(f"{name} is multimodal ({', '.join(extra_configs)}); the transformers backend serves "
                          "text-only decoders")
    if encoder:
        check_encoder(config, name, architecture)
    elif architecture not in causal_lm_architectures():
        expected = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        raise Unsupported(f"{name} is not a causal language model class"
                          + (f" (transformers' causal LM for this model type is {expected})" if expected else "")
                          + "; the transformers backend serves decoder-only causal LMs")
    check_config(config, name)
    model_cls = getattr(transformers, architecture)
    if not model_cls._supports_attention_backend:
        raise Unsupported(f"{name}: its transformers code does not route attention through transformers' "
                          "attention interface (_supports_attention_backend is False), so hookllm's paged attention "
                          "cannot take its place")
    return model_cls


def check_encoder(config: Any, name: str, architecture: str) -> None:
    """Refuse an encoder checkpoint transformers has no class for, or whose positions are an
    attention bias (relative position embeddings)."""
    model_cls = getattr(transformers, architecture, None) if architecture.isidentifier() else None
    if not (isinstance(model_cls, type) and issubclass(model_cls, transformers.PreTrainedModel)):
        raise Unsupported(f"{name}: transformers has no such model class")
    embedding = getattr(config, "position_embedding_type", "absolute")
    if embedding not in (None, "absolute", "rope", "rotary"):
        raise Unsupported(f"{name} uses {embedding!r} position embeddings, an attention bias hookllm's kernels lack")


def check_config(config: Any, name: str) -> None:
    """Refuse config fields whose meaning the backend cannot honour."""
    kinds = sorted(set(getattr(config, "layer_types", None) or ()) - set(ATTENTION_LAYER_TYPES))
    recurrent = [kind for kind in kinds if kind in RECURRENT_LAYER_TYPES]
    if recurrent:
        raise Unsupported(f"{name} has state-space / recurrent layers ({', '.join(recurrent)}); "
                          "the transformers backend serves attention-only decoders")
    if kinds:
        raise Unsupported(f"{name} has {', '.join(kinds)} layers, which hookllm's attention kernels lack")
    if getattr(config, "attention_chunk_size", None):
        raise Unsupported(f"{name} uses chunked attention (attention_chunk_size), which hookllm's kernels lack")
    if getattr(config, "num_kv_shared_layers", 0) or getattr(config, "kv_sharing_modes", None):
        raise Unsupported(f"{name} shares KV caches between layers, which the transformers backend cannot honour")
    alibi = (getattr(config, "alibi", False) or getattr(config, "position_embedding_type", None) == "alibi"
             or config.model_type in ("bloom", "mpt"))
    if alibi:
        raise Unsupported(f"{name} uses ALiBi position biases, which hookllm's attention kernels lack")
    v_head_dim, qk_rope = getattr(config, "v_head_dim", None), getattr(config, "qk_rope_head_dim", None)
    if v_head_dim is not None and qk_rope is not None:
        raise Unsupported(f"{name} uses multi-head latent attention (v_head_dim {v_head_dim} differs from the "
                          "query/key head dim), which hookllm's attention kernels lack")
    for rope in _rope_parameters(config):
        if rope.get("rope_type", rope.get("type")) in BATCH_DEPENDENT_ROPE:
            raise Unsupported(f"{name} uses {rope.get('rope_type', rope.get('type'))!r} RoPE scaling, whose "
                              "transformers code depends on the batch's longest sequence")
    method, _ = checkpoint_quant_method(config)
    if method is not None:
        raise Unsupported(f"{name} is a quantized checkpoint ({method}); the transformers backend loads "
                          "unquantized safetensors only")


def _rope_parameters(config: Any) -> list[dict]:
    """The RoPE settings: transformers 5's ``rope_parameters`` (possibly one per layer kind) or
    4.x's ``rope_scaling``."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return []
    nested = [value for value in params.values() if isinstance(value, dict)]
    return nested or [params]


def check_structure(model: nn.Module) -> None:
    """Refuse a built (empty) model that holds recurrent layers its config did not announce
    (the attention calls themselves are checked by :func:`.attention.probe`)."""
    name = f"{type(model).__name__} (model_type {model.config.model_type!r})"
    for path, module in model.named_modules():
        if RECURRENT_MODULE.search(type(module).__name__) or _is_depthwise_conv(module) or _has_ssm_state(module):
            raise Unsupported(f"{name} has state-space / recurrent layers ({path}: {type(module).__name__}); "
                              "the transformers backend serves attention-only decoders")


def _is_depthwise_conv(module: nn.Module) -> bool:
    """A causal depthwise convolution over the sequence (Mamba, gated delta nets, short convs)."""
    return isinstance(module, nn.Conv1d) and module.groups > 1 and module.groups == module.in_channels


def _has_ssm_state(module: nn.Module) -> bool:
    """The state matrix of a selective state-space layer (Mamba's ``A_log``)."""
    return "A_log" in module._parameters
