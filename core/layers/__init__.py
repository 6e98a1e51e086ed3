"""Model building blocks shared by adapters: paged attention, norms, rotary, fused and
tensor-parallel linears, vocab-parallel embedding and LM head, and the stand-in for what another
pipeline stage holds."""

from hookllm.layers.attention import Attention
from hookllm.layers.norm import RMSNorm
from hookllm.layers.rotary import RotaryEmbedding, get_rope
from hookllm.layers.activation import SiluAndMul
from hookllm.layers.linear import (
    ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
)
from hookllm.layers.pipeline import StageMissing, on_other_stage
from hookllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

__all__ = [
    "Attention", "RMSNorm", "RotaryEmbedding", "get_rope", "SiluAndMul",
    "ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear", "RowParallelLinear",
    "VocabParallelEmbedding", "ParallelLMHead", "StageMissing", "on_other_stage",
]
