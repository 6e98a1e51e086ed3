"""Native gpt-oss (``GptOssForCausalLM``): a pre-norm decoder whose layers alternate a 128-token
sliding window with full attention, each attention head with a learned sink logit, q/k/v/o
biases, YaRN RoPE, and a mixture of experts routed top-k-then-softmax through a clamped SwiGLU.

Weights load from the bf16 checkpoint layout or from the hub's MXFP4 one (experts dequantized
to the model dtype as they are read: :mod:`hookllm.adapters.gpt_oss.mxfp4`).

Tensor parallel as the Llama adapter (heads, vocabulary, and each expert's intermediate dim
split); with ``enable_expert_parallel`` each rank holds whole experts instead
(:mod:`hookllm.layers.fused_moe`). The router is replicated (every rank routes every token);
each rank keeps the sinks of its own heads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hookllm.adapters.llama.model import LlamaForCausalLM
from hookllm.kernels.reference import SWIGLU_OAI_ALPHA
from hookllm.layers import Attention, QKVParallelLinear, RowParallelLinear
from hookllm.layers.fused_moe import FusedMoE
from hookllm.layers.linear import LoadedWeight, check_loaded_shape, narrow_loaded


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class GptOssAttention(nn.Module):
    """GQA attention with biases and per-head sinks; ``sinks`` holds this rank's heads only."""

    def __init__(self, config: Any, rotary_emb: nn.Module, sliding_window: int | None):
        super().__init__()
        self.head_dim = _head_dim(config)
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        bias = getattr(config, "attention_bias", True)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_heads, total_kv_heads, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.total_heads, self.first_head = total_heads, self.qkv_proj.tp_rank * self.num_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size, bias=bias)
        # One logit per query head that joins the softmax's denominator (never read as a value).
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads,
                              sliding_window=sliding_window)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        """The sinks (this module's only own parameter): this rank's heads of the checkpoint's."""
        check_loaded_shape(loaded, (self.total_heads,), "attention sinks")
        param.data.copy_(narrow_loaded(loaded, 0, self.first_head, self.num_heads))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, sinks=self.sinks))


class GptOssRouter(nn.Module):
    """``[tokens, hidden] -> [tokens, experts]`` logits, replicated on every rank (each needs
    every expert's logit to route)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        # Left empty, as the parallel layers are: the checkpoint (or the dummy loader) fills them.
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.weight, self.bias)


class GptOssMLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.router = GptOssRouter(config.hidden_size, config.num_local_experts)
        self.experts = FusedMoE(
            config.num_local_experts, config.num_experts_per_tok, config.hidden_size, config.intermediate_size,
            softmax_first=False, activation="swiglu_oai", swiglu_limit=getattr(config, "swiglu_limit", None),
            bias=True, interleaved_gate_up=True,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.router(hidden_states))


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss-20b / -120b and any checkpoint of their config, bf16 or MXFP4: the Llama-family
    decoder with gpt-oss's attention and experts in each layer."""

    supports_expert_parallel = True  # tensor parallel as the Llama decoder it extends

    def __init__(self, config: Any):
        alpha = getattr(config, "swiglu_alpha", SWIGLU_OAI_ALPHA)
        if alpha != SWIGLU_OAI_ALPHA:
            raise ValueError(f"swiglu_alpha={alpha}: hookllm's MoE kernels implement gpt-oss's {SWIGLU_OAI_ALPHA} only")
        super().__init__(config)

    def make_attention(self, config: Any, rotary_emb: nn.Module, sliding_window: int | None) -> nn.Module:
        return GptOssAttention(config, rotary_emb, sliding_window)

    def make_mlp(self, config: Any, layer_index: int) -> nn.Module:
        return GptOssMLP(config)

    def mxfp4_shapes(self) -> dict[str, tuple[int, int, int]]:
        """Each quantizable checkpoint tensor's ``(experts, rows, cols)``: rows the outputs, cols
        the inputs, as the MXFP4 blocks store them."""
        c = self.config
        experts, hidden, inter = c.num_local_experts, c.hidden_size, c.intermediate_size
        shapes = {}
        for i in range(len(self.model.layers)):
            prefix = f"model.layers.{i}.mlp.experts"
            shapes[f"{prefix}.gate_up_proj"] = (experts, 2 * inter, hidden)
            shapes[f"{prefix}.down_proj"] = (experts, hidden, inter)
        return shapes

