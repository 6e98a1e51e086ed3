"""Native Llama-family decoders: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm).

One implementation serves all four; the differences are two flags read from the class. Weights
load from HF checkpoints, with q/k/v and gate/up fused into single matmuls. A subclass swaps a
layer's attention and feed-forward blocks through ``make_attention`` and ``make_mlp`` and maps
extra checkpoint names through ``rename_weight`` (the MoE adapters, ``hookllm.adapters.moe`` and
``hookllm.adapters.gpt_oss``, do).

Tensor parallel (``supports_tensor_parallel``): attention heads, the MLP's intermediate dim and
the vocabulary are split across ranks (see docs/tensor-parallel.md); with one rank the layers
are the plain matmuls. Pipeline parallel (``supports_pipeline_parallel``): a stage builds and
loads only its layers (:class:`hookllm.layers.StageMissing` stands in for the rest).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from hookllm.config import layer_sliding_windows
from hookllm.distributed import custom_all_reduce_enabled, is_first_stage, is_last_stage, stage_layer_range
from hookllm.layers import (
    Attention, MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RMSNorm, RowParallelLinear,
    SiluAndMul, StageMissing, VocabParallelEmbedding, get_rope, on_other_stage,
)
from hookllm.layers.linear import LoadedWeight
from hookllm.worker.model_loader import load_weights_into


def rope_settings(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(base, scaling) from either config style: transformers 5 ``rope_parameters`` or 4.x fields."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return base, params


class DecoderAttention(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, rotary_emb: nn.Module, sliding_window: int | None):
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_heads, total_kv_heads, bias=qkv_bias)
        # This rank's heads: the paged KV cache holds only the local KV heads.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim, config.hidden_size, bias=getattr(config, "attention_bias", False)
        )
        self.rotary_emb = rotary_emb
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads,
                              sliding_window=sliding_window)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class DecoderMLP(nn.Module):
    """The gated SiLU MLP; ``intermediate_size`` overrides the config's and ``reduce_results=False``
    leaves its tensor-parallel sum to the caller (both for Qwen2-MoE's shared expert)."""

    def __init__(self, config: Any, intermediate_size: int | None = None, reduce_results: bool = True):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        inter = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, {"gate": inter, "up": inter}, bias=bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias, reduce_results=reduce_results)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm residual block around the attention and feed-forward modules it is given."""

    def __init__(self, config: Any, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
        aux_out: Sequence[torch.Tensor] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``aux_out``: views the residual stream entering the layer is written into (the sum the
        input norm makes anyway, reduced over tensor-parallel ranks)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        for out in aux_out:
            out.copy_(residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DecoderModel(nn.Module):
    """``make_attention(config, rotary_emb, sliding_window)`` and ``make_mlp(config, layer_index)``
    build each layer's attention and feed-forward blocks."""

    def __init__(self, config: Any, make_attention: Callable[[Any, nn.Module, int | None], nn.Module],
                 make_mlp: Callable[[Any, int], nn.Module]):
        super().__init__()
        self.start_layer, self.end_layer = stage_layer_range(config.num_hidden_layers)
        self.is_last_stage = is_last_stage()
        # The last stage keeps the embedding too when the head shares its weight.
        tied = getattr(config, "tie_word_embeddings", False)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size)
                             if is_first_stage() or (self.is_last_stage and tied) else StageMissing())
        # One cos/sin table shared by every layer (it is max_position x head_dim floats).
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base, scaling = rope_settings(config)
        rotary_emb = get_rope(head_dim, config.max_position_embeddings, base, scaling)
        # Mistral v0.1 slides every layer; Qwen2 with use_sliding_window only those from max_window_layers.
        self.layers = nn.ModuleList(
            DecoderLayer(config, make_attention(config, rotary_emb, window), make_mlp(config, index))
            if self.start_layer <= index < self.end_layer else StageMissing()
            for index, window in enumerate(layer_sliding_windows(config))
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last_stage else StageMissing()
        if custom_all_reduce_enabled():
            defer_reductions_to_norms(self)
        # keep_aux_hidden_states: the buffer (persistent: the engine's memory budget counts it with
        # the weights), and which of its column ranges each layer's input fills.
        self.register_buffer("aux_hidden_states", None)
        self.aux_columns: dict[int, list[slice]] = {}

    def keep_aux_hidden_states(self, layers: Sequence[int], max_tokens: int) -> torch.Tensor:
        # Any of this stage's layers tells the width, dtype and device of the residual stream.
        weight = self.layers[self.start_layer].input_layernorm.weight
        hidden = weight.shape[0]
        self.aux_columns = {}
        for column, layer in enumerate(layers):
            if not self.start_layer <= layer < self.end_layer:
                raise ValueError(f"aux hidden states: layer {layer} is not among this model's layers "
                                 f"{self.start_layer} .. {self.end_layer - 1}")
            self.aux_columns.setdefault(layer, []).append(slice(column * hidden, (column + 1) * hidden))
        self.aux_hidden_states = torch.zeros(max_tokens, len(layers) * hidden, dtype=weight.dtype, device=weight.device)
        return self.aux_hidden_states

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None,
        intermediate_tensors: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm; on a pipeline stage before the last, the
        ``[2, num_tokens, hidden]`` hidden states and residual for the next stage."""
        if intermediate_tensors is None:
            hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            hidden_states, residual = intermediate_tensors.unbind(0)
        aux, columns = self.aux_hidden_states, self.aux_columns
        for index in range(self.start_layer, self.end_layer):
            aux_out = [aux[:positions.shape[0], c] for c in columns[index]] if index in columns else ()
            hidden_states, residual = self.layers[index](positions, hidden_states, residual, aux_out)
        if not self.is_last_stage:
            return torch.stack((hidden_states, residual))
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


def defer_reductions_to_norms(model: DecoderModel) -> None:
    """Leave the tensor-parallel sum of each layer's o and down projections to the RMSNorm after
    it (the layer's post-attention norm, the next layer's input norm, the final norm), which does
    the sum, the residual add and the norm in one kernel. A block without such a projection (an
    MoE layer's experts) keeps its own reduce."""
    norms_after_mlp = [layer.input_layernorm for layer in model.layers[1:]] + [model.norm]
    for layer, norm_after_mlp in zip(model.layers, norms_after_mlp):
        _defer_reduction(getattr(layer.self_attn, "o_proj", None), layer.post_attention_layernorm)
        _defer_reduction(getattr(layer.mlp, "down_proj", None), norm_after_mlp)


def _defer_reduction(projection: nn.Module | None, norm: RMSNorm) -> None:
    if isinstance(projection, RowParallelLinear) and projection.reduce_results:
        projection.reduce_results = False  # its bias is then added by rank 0 alone, before the sum
        norm.reduces_input = True


class LlamaForCausalLM(nn.Module):
    """Llama decoder; subclasses switch on Qwen2's qkv bias and Qwen3's per-head q/k RMSNorm."""

    # Opt-in checked by hookllm.distributed.check_tensor_parallel: built from the parallel
    # layers, and load_weights accepts lazy safetensors slices.
    supports_tensor_parallel = True
    supports_quantization = True  # its parallel linear (and MoE) layers take a quantization method
    supports_pipeline_parallel = True
    qkv_bias = False
    qk_norm = False

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.make_attention, self.make_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size) if is_last_stage() else StageMissing()
        if getattr(config, "tie_word_embeddings", False) and is_last_stage():
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_attention(self, config: Any, rotary_emb: nn.Module, sliding_window: int | None) -> nn.Module:
        """One layer's attention block (called while ``__init__`` builds the layers)."""
        qkv_bias = self.qkv_bias or getattr(config, "attention_bias", False)
        return DecoderAttention(config, qkv_bias, self.qk_norm, rotary_emb, sliding_window)

    def make_mlp(self, config: Any, layer_index: int) -> nn.Module:
        """Layer ``layer_index``'s feed-forward block (called while ``__init__`` builds the layers)."""
        return DecoderMLP(config)

    def rename_weight(self, name: str) -> tuple[str, str | None] | None:
        """The ``(parameter, shard)`` a checkpoint tensor loads into, asked before the q/k/v and
        gate/up fusing rules of ``load_weights``; None leaves it to them (every dense checkpoint)."""
        return None

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None,
        intermediate_tensors: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits on every rank (the head all-gathers its vocabulary shards)."""
        return self.lm_head(hidden_states)

    def keep_aux_hidden_states(self, layers: Sequence[int], max_tokens: int) -> torch.Tensor:
        """:class:`hookllm.plugins.contract.SupportsAuxHiddenStates` (an EAGLE-3 head's inputs)."""
        return self.model.keep_aux_hidden_states(layers, max_tokens)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> None:
        """Whole tensors or lazy safetensors slices; each parallel layer copies its rank's shard."""
        tied = getattr(self.config, "tie_word_embeddings", False)
        load_weights_into(
            self,
            weights,
            stacked=[
                (".qkv_proj", ".q_proj", "q"),
                (".qkv_proj", ".k_proj", "k"),
                (".qkv_proj", ".v_proj", "v"),
                (".gate_up_proj", ".gate_proj", "gate"),
                (".gate_up_proj", ".up_proj", "up"),
            ],
            # Old checkpoints carry rotary tables; tied ones may still save a copy of lm_head.
            skip=lambda name: ("rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight")
                               or on_other_stage(self, name)),
            rename=self.rename_weight,
        )


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
