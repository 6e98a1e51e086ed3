"""Tensor parallelism for the transformers backend: each rank keeps its slice of the weights the
model's own tensor-parallel plan splits.

transformers' configs carry that plan, ``base_model_tp_plan``: names in the base model, with
``*`` for a layer number (``"layers.*.self_attn.q_proj"``), mapped to styles. :func:`shard`
applies it to the model built on the meta device, before any parameter has storage, so a rank
allocates, and reads from the checkpoint, only its part:

- ``colwise`` / ``rowwise`` on an ``nn.Linear``: hookllm's ``ColumnParallelLinear`` (output
  features split; the output stays split) / ``RowParallelLinear`` (input features split, partial
  sums all-reduced, the bias added once) take its place. Plans split q/k/v by output features and
  o_proj by input features; transformers' attention modules reshape with ``-1`` heads, so they
  run on this rank's heads, and the probe (:func:`.attention.probe`, run after this) records
  those counts for the paged KV cache.
- Stacked MoE expert parameters, ``[experts, out, in]``, in either of the two ways transformers
  has planned them. Its tensor-parallel plan (up to 5.24): ``packed_colwise`` splits the gate half
  and the up half of ``gate_up_proj`` each, ``colwise`` the output features, ``rowwise`` the input
  features; each rank runs its slice of every expert's intermediate features (transformers'
  experts code reads sizes from the tensors) and ``moe_tp_experts`` on the experts module sums the
  partial outputs over the ranks. Its expert-parallel plan (``base_model_ep_plan``, from 5.25,
  applied where the tensor-parallel plan leaves the experts alone): ``grouped_gemm`` keeps this
  rank's whole experts, and ``ep_dispatch_experts`` on the experts module hands them only the
  tokens routed to them (the others get the experts code's "no expert" id, ``num_experts``, and
  weight 0) and sums the outputs over the ranks, as transformers' own all-reduce dispatch does.
- Styles under which a module's output is whole on every rank keep the module whole: replicated
  norms, embeddings (and the LM head, which the base model's plan does not name: every rank
  computes full logits, as hookllm's runner expects), and the ``*_gather_output`` /
  ``*_split_input`` styles (a split layer whose output is gathered, or whose whole input is
  split and summed back, computes what the whole layer computes).

Anything else is refused with :class:`~.support.Unsupported` before a weight is read: no plan, a
plan that splits nothing, any other style, a style on a module it does not fit, a count that
does not split evenly over the ranks (heads, features), and expert parameters that an
all-reduce would add once per rank (a bias) or that no all-reduce sums.

A split parameter carries ``weight_loader(param, loaded)``, which copies this rank's part of the
full checkpoint tensor or of a lazy safetensors slice (reading only that part), and
``checkpoint_shape``, its shape in the checkpoint; :mod:`.weights` loads through them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from hookllm.adapters.transformers.support import Unsupported
from hookllm.distributed import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from hookllm.layers import ColumnParallelLinear, RowParallelLinear
from hookllm.layers.linear import LoadedWeight, check_loaded_shape, narrow_loaded

# Styles under which the module's output is whole on every rank: the module stays whole.
WHOLE_STYLES = frozenset({"replicate", "replicated_with_grad_allreduce", "embedding_rowwise", "embedding_colwise",
                          "colwise_gather_output", "colwise_rep", "rowwise_split_input", "rowwise_rep"})
PARALLEL_LINEARS: dict[str, type[nn.Module]] = {"colwise": ColumnParallelLinear, "rowwise": RowParallelLinear}
FEATURE_EXPERTS_STYLE = "moe_tp_experts"
DISPATCH_EXPERTS_STYLE = "ep_dispatch_experts"
EXPERTS_STYLES = frozenset({FEATURE_EXPERTS_STYLE, DISPATCH_EXPERTS_STYLE})


@dataclass(frozen=True)
class ExpertSplit:
    """How a style splits a stacked expert parameter ``[experts, out, in]``: along ``dim``, each
    of its ``blocks`` packed projections (gate and up: 2) separately; ``module_style`` is the
    style its experts module needs to combine the ranks' parts."""

    dim: int
    blocks: int = 1
    module_style: str = FEATURE_EXPERTS_STYLE


EXPERT_SPLITS = {"colwise": ExpertSplit(1), "packed_colwise": ExpertSplit(1, blocks=2), "rowwise": ExpertSplit(2),
                 "grouped_gemm": ExpertSplit(0, module_style=DISPATCH_EXPERTS_STYLE)}


def shard(model: nn.Module) -> None:
    """Split ``model`` (built on the meta device, not yet materialized) over this process's
    tensor-parallel ranks as its config's plan says; nothing to do with one rank."""
    size = get_tp_size()
    if size == 1:
        return
    name = type(model).__name__
    base = model.base_model
    expert_plan = getattr(model.config, "base_model_ep_plan", None) or {}
    # The tensor-parallel plan's style wins where both plans name a module or parameter.
    styles = {**_planned_styles(base, expert_plan), **_planned_styles(base, _plan(model, name))}
    _check_styles(name, styles)
    _check_heads(name, model.config, size)
    for path, style in styles.items():
        if style in WHOLE_STYLES:
            continue
        module = _module_at(base, path)
        if module is None:
            _split_expert_parameter(name, base, path, styles, size)
        elif style in EXPERTS_STYLES:
            _combine_over_ranks(name, module, path, style, styles, size)
        else:
            _replace_linear(name, base, path, style, size)


def _planned_styles(base: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The style of each module and parameter of ``base`` the plan names (its first pattern
    that matches; ``*`` stands for one name component, a layer number)."""
    patterns = [(re.compile(re.escape(pattern).replace(r"\*", r"[^.]+")), style) for pattern, style in plan.items()]
    names = [path for path, _ in base.named_modules() if path] + [path for path, _ in base.named_parameters()]
    styles = {}
    for path in names:
        style = next((style for regex, style in patterns if regex.fullmatch(path)), None)
        if style is not None:
            styles[path] = style
    return styles


def _plan(model: nn.Module, name: str) -> dict[str, str]:
    plan = getattr(model.config, "base_model_tp_plan", None)
    if not plan:
        raise Unsupported(f"{name}: its transformers config has no tensor-parallel plan (base_model_tp_plan), so "
                          "the transformers backend cannot split it over ranks")
    return plan


def _check_styles(name: str, styles: dict[str, str]) -> None:
    """Refuse a style the backend lacks, and a plan that keeps every weight whole (each rank
    would hold and compute the whole model)."""
    splitting = set(PARALLEL_LINEARS) | set(EXPERT_SPLITS) | EXPERTS_STYLES
    for path, style in styles.items():
        if style not in splitting | WHOLE_STYLES:
            raise Unsupported(f"{name}: its tensor-parallel plan gives {path} the style {style!r}, which the "
                              "transformers backend cannot apply")
    if not any(style in splitting for style in styles.values()):
        kept = ", ".join(sorted(set(styles.values()))) or "no style"
        raise Unsupported(f"{name}: its tensor-parallel plan splits no weight ({kept}), so every rank would hold "
                          "and compute the whole model")


def _check_heads(name: str, config: Any, size: int) -> None:
    """Plans split q/k/v by output features: with a head count the ranks do not divide, a rank
    would hold part of a head (and the backend does not replicate KV heads)."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for field, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if count is not None and count % size:
            raise Unsupported(f"{name}: {field}={count} is not divisible by tensor_parallel_size={size}; the "
                              "transformers backend splits attention by whole heads and does not replicate them")


def _replace_linear(name: str, base: nn.Module, path: str, style: str, size: int) -> None:
    """Put hookllm's column- or row-parallel linear in place of the ``nn.Linear`` at ``path``."""
    linear = base.get_submodule(path)
    if style not in PARALLEL_LINEARS or type(linear) is not nn.Linear:
        raise Unsupported(f"{name}: its tensor-parallel plan gives {path} ({type(linear).__name__}) the style "
                          f"{style!r}; the transformers backend splits nn.Linear modules colwise or rowwise only")
    features, which = (linear.out_features, "output") if style == "colwise" else (linear.in_features, "input")
    _check_divisible(name, f"{path} ({style}) has {features} {which} features", features, size)
    with torch.device("meta"):
        parallel = PARALLEL_LINEARS[style](linear.in_features, linear.out_features, bias=linear.bias is not None)
    parallel.to(linear.weight.dtype)
    for param_name, param in parallel.named_parameters():
        _mark_split(param, tuple(getattr(linear, param_name).shape), parallel.weight_loader)
    parent, _, child = path.rpartition(".")
    setattr(base.get_submodule(parent), child, parallel)


def _split_expert_parameter(name: str, base: nn.Module, path: str, styles: dict[str, str], size: int) -> None:
    """Keep this rank's part of the stacked expert parameter at ``path`` (still on meta)."""
    owner_path, _, param_name = path.rpartition(".")
    param = base.get_parameter(path)
    style = styles[path]
    if style not in EXPERT_SPLITS or param.dim() != 3:
        raise Unsupported(f"{name}: its tensor-parallel plan gives the parameter {path} {tuple(param.shape)} the "
                          f"style {style!r}; the transformers backend splits stacked expert parameters "
                          "[experts, out, in] colwise, packed_colwise, rowwise or grouped_gemm only")
    split, full = EXPERT_SPLITS[style], tuple(param.shape)
    if styles.get(owner_path) != split.module_style:
        raise Unsupported(f"{name}: its tensor-parallel plan splits {path} but does not sum the output of "
                          f"{owner_path} over the ranks ({split.module_style})")
    block = full[split.dim] // split.blocks
    counted = "experts" if split.dim == 0 else f"features along dim {split.dim}"
    _check_divisible(name, f"{path} has {block} {counted}"
                     + (f" in each of its {split.blocks} packed blocks" if split.blocks > 1 else ""), block, size)
    local = full[:split.dim] + (full[split.dim] // size,) + full[split.dim + 1:]
    part = nn.Parameter(torch.empty(local, dtype=param.dtype, device="meta"), requires_grad=False)
    _mark_split(part, full, _ExpertLoader(split, get_tp_rank()))
    base.get_submodule(owner_path)._parameters[param_name] = part


def _combine_over_ranks(name: str, experts: nn.Module, path: str, style: str, styles: dict[str, str],
                        size: int) -> None:
    """All-reduce the output of the experts module at ``path``: each rank computed a partial sum,
    from its slice of every expert's features or from its own experts. Every parameter of the
    module must be split the way ``style`` combines: a whole one (a bias) would be added once per
    rank."""
    whole = [f"{path}.{param}" for param, _ in experts.named_parameters()
             if getattr(EXPERT_SPLITS.get(styles.get(f"{path}.{param}")), "module_style", None) != style]
    if whole:
        raise Unsupported(f"{name}: its tensor-parallel plan sums the output of {path} over the ranks "
                          f"({style}) but leaves {whole[0]} whole, which would then count once per rank")
    if style == DISPATCH_EXPERTS_STYLE:
        if not isinstance(getattr(experts, "num_experts", None), int):
            raise Unsupported(f"{name}: its expert-parallel plan dispatches to {path} ({type(experts).__name__}), "
                              "which has no num_experts to route by")
        local = experts.num_experts // size
        experts.register_forward_pre_hook(_LocalExpertRouting(get_tp_rank() * local, local), with_kwargs=True)
        experts.num_experts = local
        experts._is_expert_parallel = True  # transformers' batched experts code then skips the "no expert" id
    experts.register_forward_hook(_all_reduce_output)


def _all_reduce_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return tensor_model_parallel_all_reduce(output)


@dataclass(frozen=True)
class _LocalExpertRouting:
    """Before an experts module holding experts ``first .. first + count - 1`` runs: routes to
    other ranks' experts become the id ``count`` ("no expert") with weight 0, the rest local ids.
    transformers calls experts as ``(hidden_states, top_k_index, top_k_weights)``."""

    first: int
    count: int

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        inputs = dict(zip(("hidden_states", "top_k_index", "top_k_weights"), args)) | kwargs
        index = inputs["top_k_index"]
        elsewhere = (index < self.first) | (index >= self.first + self.count)
        inputs["top_k_index"] = torch.where(elsewhere, self.count, index - self.first)
        inputs["top_k_weights"] = inputs["top_k_weights"].masked_fill(elsewhere, 0.0)
        return (), inputs


@dataclass(frozen=True)
class _ExpertLoader:
    """The ``weight_loader`` of a split expert parameter: this rank's slice of each packed block
    of the full checkpoint tensor (a lazy slice reads only those)."""

    split: ExpertSplit
    rank: int

    def __call__(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        check_loaded_shape(loaded, param.checkpoint_shape, "stacked expert parameter")
        dim, blocks = self.split.dim, self.split.blocks
        block, local = param.checkpoint_shape[dim] // blocks, param.shape[dim] // blocks
        parts = [narrow_loaded(loaded, dim, index * block + self.rank * local, local) for index in range(blocks)]
        param.data.copy_(torch.cat(parts, dim))


def _mark_split(param: nn.Parameter, checkpoint_shape: tuple[int, ...],
                weight_loader: Callable[[nn.Parameter, LoadedWeight], None]) -> None:
    """What :mod:`.weights` loads a split parameter through."""
    param.checkpoint_shape = checkpoint_shape
    param.weight_loader = weight_loader


def _check_divisible(name: str, what: str, count: int, size: int) -> None:
    if count % size:
        raise Unsupported(f"{name}: {what}, which do not split evenly over {size} ranks")


def _module_at(base: nn.Module, path: str) -> nn.Module | None:
    """The module at ``path``; None where the plan names a parameter."""
    try:
        return base.get_submodule(path)
    except AttributeError:
        return None
