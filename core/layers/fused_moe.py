"""The mixture-of-experts layer every MoE adapter uses: router top-k, then all experts in two
grouped GEMMs (:mod:`hookllm.kernels.triton_moe` on CUDA, the torch reference elsewhere).

Experts across ranks, two ways (``hookllm.distributed``):

- **Tensor parallel** (the default): every rank holds every expert, with its intermediate
  dimension split as a dense MLP's is (gate/up rows column-parallel, down columns row-parallel);
  each rank's partial outputs are summed by one all-reduce per layer.
- **Expert parallel** (``enable_expert_parallel``): rank ``r`` of ``n`` holds whole experts
  ``[r * E / n, (r + 1) * E / n)``. Every rank holds every token (attention is tensor
  parallel), so each computes its own experts' share for the tokens routed to them, and the
  same one all-reduce sums the shares; the pairs routed elsewhere cost no FLOPs and no weight
  bytes. (Exchanging tokens with all-to-all pays only when ranks hold different tokens, as
  with data-parallel attention, which hookllm does not have: see docs/models.md.)

Weights are stacked per layer, ``gate_up_proj`` ``[experts, 2 * inter, hidden]`` (each expert's
gate rows, then its up rows) and ``down_proj`` ``[experts, hidden, inter]``, and load from either
checkpoint layout: one tensor per expert and projection (Mixtral, Qwen-MoE on the hub) or stacked
tensors (gpt-oss: ``[experts, hidden, 2 * inter]`` with gate and up columns interleaved).
"""

from __future__ import annotations

import math
import re
from typing import Callable

import torch
from torch import nn

from hookllm.distributed import expert_parallel_enabled, get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from hookllm.layers.linear import LoadedWeight, check_loaded_shape, loaded_shape, materialize
from hookllm.kernels import reference
from hookllm.kernels.reference import check_moe_activation

# Per-expert checkpoint tensors: shard "<projection>:<expert>" (``gate:3``); stacked ones: None.
EXPERT_PROJECTIONS = ("gate", "up", "down")


def _moe_kernels(hidden: torch.Tensor):
    """Triton's fused MoE on CUDA; the torch reference (a loop over experts) elsewhere."""
    if hidden.is_cuda:
        from hookllm.kernels import triton_moe

        return triton_moe
    return reference


# A weight, or a quantized weight's scale (``weight_scale``, or ``weight_scale_inv`` as Hugging
# Face's FP8 checkpoints name theirs), which goes to the stacked parameter's ``..._scale``.
_EXPERT_TENSOR = re.compile(
    r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight(?P<scale>_scale(?:_inv)?)?$")


def expert_tensor_renamer(projections: dict[str, str]) -> Callable[[str], tuple[str, str] | None]:
    """A ``rename`` for :func:`hookllm.worker.model_loader.load_weights_into` that sends
    per-expert checkpoint tensors to the stacked parameters of a :class:`FusedMoE` named
    ``...experts``: with ``{"w1": "gate", "w3": "up", "w2": "down"}`` (Mixtral),
    ``...experts.3.w1.weight`` becomes shard ``"gate:3"`` of ``...experts.gate_up_proj``, and its
    ``weight_scale`` the same shard of ``...experts.gate_up_proj_scale``."""
    def rename(name: str) -> tuple[str, str] | None:
        match = _EXPERT_TENSOR.match(name)
        if match is None or match["proj"] not in projections:
            return None
        kind = projections[match["proj"]]
        param = ("down_proj" if kind == "down" else "gate_up_proj") + ("_scale" if match["scale"] else "")
        return f"{match['experts']}.{param}", f"{kind}:{match['expert']}"

    return rename


class FusedMoE(nn.Module):
    """One layer's experts and their routing: ``forward(hidden, router_logits)`` returns the
    routing-weighted sum of each token's ``top_k`` experts, summed over ranks.

    ``softmax_first``/``renormalize``: the routing order and renormalisation (see
    :func:`hookllm.kernels.reference.route`); ``activation`` and ``swiglu_limit``: the gated
    activation (:func:`hookllm.kernels.reference.moe_activation`); ``bias``: per-expert biases on
    both projections (gpt-oss); ``interleaved_gate_up``: stacked checkpoint tensors are gpt-oss's
    ``[in, out]`` matrices with gate and up columns alternating; ``reduce_results=False``: this
    rank's share is returned unsummed, for a caller that adds more partial sums (a shared expert)
    before one all-reduce.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 softmax_first: bool = True, renormalize: bool = False, activation: str = "silu",
                 swiglu_limit: float | None = None, bias: bool = False, interleaved_gate_up: bool = False,
                 reduce_results: bool = True):
        super().__init__()
        check_moe_activation(activation, swiglu_limit)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.expert_parallel = expert_parallel_enabled() and self.tp_size > 1
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.softmax_first, self.renormalize = softmax_first, renormalize
        self.activation, self.swiglu_limit = activation, swiglu_limit
        self.interleaved_gate_up = interleaved_gate_up
        self.reduce_results = reduce_results
        if self.expert_parallel:
            if num_experts % self.tp_size:
                raise ValueError(f"num_experts={num_experts} is not divisible by the {self.tp_size} expert-parallel ranks")
            self.num_local_experts, self.local_inter = num_experts // self.tp_size, intermediate_size
            self.first_expert = self.tp_rank * self.num_local_experts
        else:
            if intermediate_size % self.tp_size:
                raise ValueError(f"moe intermediate size {intermediate_size} is not divisible by "
                                 f"tensor_parallel_size={self.tp_size}")
            self.num_local_experts, self.local_inter = num_experts, intermediate_size // self.tp_size
            self.first_expert = 0
        experts, inter = self.num_local_experts, self.local_inter
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(experts, hidden_size, inter), requires_grad=False)
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter), requires_grad=False)
            self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden_size), requires_grad=False)
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None
        # A quantization method's (hookllm.plugins.quantization.MoeMethod) e4m3 experts' scales:
        # ``[experts, rows, column groups]`` float32, each with a ``param_layout``.
        self.register_parameter("gate_up_proj_scale", None)
        self.register_parameter("down_proj_scale", None)
        self.quant_method = None

    def extra_repr(self) -> str:
        placement = (f"experts {self.first_expert}..{self.first_expert + self.num_local_experts - 1} of "
                     f"{self.num_experts}" if self.expert_parallel else f"all {self.num_experts} experts")
        return (f"{placement}, top_k={self.top_k}, hidden={self.hidden_size}, local inter={self.local_inter}, "
                f"activation={self.activation}, tp_rank={self.tp_rank}/{self.tp_size}")

    # -- forward ---------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """``hidden_states`` ``[tokens, hidden]``, ``router_logits`` ``[tokens, experts]`` (every
        expert's, on every rank) -> ``[tokens, hidden]``, all-reduced over ranks unless
        ``reduce_results`` is off."""
        kernels = _moe_kernels(hidden_states)
        weights, ids = kernels.route(router_logits, self.top_k, renormalize=self.renormalize,
                                     softmax_first=self.softmax_first)
        if self.expert_parallel:
            # This rank's experts become 0..local-1; the others ``num_local_experts`` (absent here).
            local = ids - self.first_expert
            ids = torch.where((local >= 0) & (local < self.num_local_experts), local,
                              torch.full_like(local, self.num_local_experts))
        out = kernels.fused_moe(
            hidden_states, self.gate_up_proj, self.down_proj, weights, ids, activation=self.activation,
            gate_up_bias=self.gate_up_proj_bias, down_bias=self._down_bias(), swiglu_limit=self.swiglu_limit,
            experts_elsewhere=self.expert_parallel, gate_up_scale=self.gate_up_proj_scale,
            down_scale=self.down_proj_scale)
        return tensor_model_parallel_all_reduce(out) if self.reduce_results else out

    def _down_bias(self) -> torch.Tensor | None:
        # Split over the intermediate dim, every rank's partial sum would add the bias: rank 0 alone does.
        if self.down_proj_bias is None or (self.tp_rank and not self.expert_parallel):
            return None
        return self.down_proj_bias

    # -- loading ---------------------------------------------------------------------------
    def expected_shards(self, param_name: str) -> list[str | None]:
        """Every shard ``weight_loader`` must receive for ``param_name`` (``gate_up_proj``...):
        one per expert and projection. A stacked checkpoint tensor (shard None) counts for all."""
        if param_name.endswith("_bias"):
            return [None]
        kinds = ("gate", "up") if param_name.startswith("gate_up_proj") else ("down",)
        local = range(self.first_expert, self.first_expert + self.num_local_experts)
        return [f"{kind}:{e}" for kind in kinds for e in local]

    def _is_local(self, expert: int) -> bool:
        return self.first_expert <= expert < self.first_expert + self.num_local_experts

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard: str | None = None) -> list[str | None]:
        """Copy this rank's part of a checkpoint tensor into ``param``; returns the shards filled.

        ``shard`` ``"gate:e"``/``"up:e"``: expert ``e``'s ``[inter, hidden]`` projection;
        ``"down:e"``: its ``[hidden, inter]`` one; None: a stacked tensor of every expert in the
        checkpoint's layout (``[experts, 2 * inter, hidden]`` / ``[experts, hidden, inter]``,
        or gpt-oss's ``[experts, hidden, 2 * inter]`` interleaved / ``[experts, inter, hidden]``),
        or a stacked bias. A tensor of an expert another rank holds is skipped."""
        name = next(n for n, p in self._parameters.items() if p is param)
        if shard is not None:
            kind, _, expert = shard.partition(":")
            if kind not in EXPERT_PROJECTIONS or not expert.isdigit() or int(expert) >= self.num_experts:
                raise ValueError(f"unknown expert shard {shard!r} (num_experts={self.num_experts})")
            if not self._is_local(int(expert)):
                return [shard]
            if name.endswith("_scale"):
                self._load_expert_scale(param, loaded, kind, int(expert) - self.first_expert)
            else:
                self._load_expert(param, loaded, kind, int(expert) - self.first_expert)
            return [shard]
        if name.endswith("_scale"):
            raise ValueError("stacked expert weight scales are not supported: the checkpoint must hold one per expert")
        self._load_stacked(name, param, loaded)
        return self.expected_shards(name)

    def _inter_range(self) -> tuple[int, int]:
        """This rank's rows of the intermediate dimension."""
        start = 0 if self.expert_parallel else self.tp_rank * self.local_inter
        return start, start + self.local_inter

    def _load_expert(self, param: nn.Parameter, loaded: LoadedWeight, kind: str, local: int) -> None:
        lo, hi = self._inter_range()
        inter, hidden = self.intermediate_size, self.hidden_size
        if kind == "down":
            check_loaded_shape(loaded, (hidden, inter), "expert down projection")
            param.data[local].copy_(loaded[:, lo:hi])
            return
        check_loaded_shape(loaded, (inter, hidden), f"expert {kind} projection")
        param.data[local, self._gate_up_rows(kind)].copy_(loaded[lo:hi])

    def _gate_up_rows(self, kind: str) -> slice:
        """Where a rank's gate or up rows lie in its ``gate_up_proj``."""
        return slice(0, self.local_inter) if kind == "gate" else slice(self.local_inter, 2 * self.local_inter)

    def _load_expert_scale(self, param: nn.Parameter, loaded: LoadedWeight, kind: str, local: int) -> None:
        """Expert ``local``'s scale of one projection, as its ``param_layout`` says the checkpoint
        holds it: one value (``scalar_fill``), one per row, or one per block of ``out_block`` rows
        and ``in_block`` columns. Stored per row of this rank's shard and group of its columns."""
        layout = param.param_layout
        rows, cols = (self.hidden_size, self.intermediate_size) if kind == "down" else \
            (self.intermediate_size, self.hidden_size)
        what = f"expert {kind} projection's weight scale"
        if layout.scalar_fill:
            if math.prod(loaded_shape(loaded)) != 1:
                raise ValueError(f"{what}: a per-tensor scale must be one value, got shape {loaded_shape(loaded)}")
            scale = materialize(loaded).float().reshape(1, 1).expand(rows, 1)
        else:
            blocked = layout.in_block > 1
            check_loaded_shape(loaded, (-(-rows // layout.out_block), -(-cols // layout.in_block)) if blocked
                               else (rows, 1), what)
            scale = materialize(loaded).float().repeat_interleave(layout.out_block, 0)[:rows]
        lo, hi = self._inter_range()
        if kind == "down":
            if scale.shape[1] > 1:  # this rank's blocks of intermediate columns
                if lo % layout.in_block and lo // layout.in_block != (hi - 1) // layout.in_block:
                    raise ValueError(f"this rank's intermediate columns {lo}..{hi} do not start on a scale "
                                     f"block of {layout.in_block}")
                scale = scale[:, lo // layout.in_block:-(-hi // layout.in_block)]
            param.data[local].copy_(scale)
        else:
            param.data[local, self._gate_up_rows(kind)].copy_(scale[lo:hi])

    def _load_stacked(self, name: str, param: nn.Parameter, loaded: LoadedWeight) -> None:
        lo, hi = self._inter_range()
        e0, e1 = self.first_expert, self.first_expert + self.num_local_experts
        inter, hidden, n = self.intermediate_size, self.hidden_size, self.local_inter
        E = self.num_experts
        if name == "gate_up_proj":
            if self.interleaved_gate_up:  # [E, hidden, 2 * inter], gate and up columns alternating
                check_loaded_shape(loaded, (E, hidden, 2 * inter), "stacked gate_up_proj")
                cols = loaded[e0:e1, :, 2 * lo:2 * hi]
                param.data.copy_(torch.cat([cols[..., 0::2], cols[..., 1::2]], dim=-1).transpose(1, 2))
            else:  # [E, 2 * inter, hidden], gate rows then up rows
                check_loaded_shape(loaded, (E, 2 * inter, hidden), "stacked gate_up_proj")
                param.data[:, :n].copy_(loaded[e0:e1, lo:hi])
                param.data[:, n:].copy_(loaded[e0:e1, inter + lo:inter + hi])
        elif name == "down_proj":
            if self.interleaved_gate_up:  # gpt-oss's [E, inter, hidden]
                check_loaded_shape(loaded, (E, inter, hidden), "stacked down_proj")
                param.data.copy_(loaded[e0:e1, lo:hi].transpose(1, 2))
            else:
                check_loaded_shape(loaded, (E, hidden, inter), "stacked down_proj")
                param.data.copy_(loaded[e0:e1, :, lo:hi])
        elif name == "gate_up_proj_bias":
            check_loaded_shape(loaded, (E, 2 * inter), "stacked gate_up_proj_bias")
            if self.interleaved_gate_up:
                cols = loaded[e0:e1, 2 * lo:2 * hi]
                param.data.copy_(torch.cat([cols[:, 0::2], cols[:, 1::2]], dim=-1))
            else:
                param.data[:, :n].copy_(loaded[e0:e1, lo:hi])
                param.data[:, n:].copy_(loaded[e0:e1, inter + lo:inter + hi])
        else:  # down_proj_bias
            check_loaded_shape(loaded, (E, hidden), "stacked down_proj_bias")
            param.data.copy_(loaded[e0:e1])
