"""Model building blocks shared by adapters: paged attention, norms, rotary, fused linears."""

from hookllm.layers.attention import Attention
from hookllm.layers.norm import RMSNorm
from hookllm.layers.rotary import RotaryEmbedding, get_rope
from hookllm.layers.activation import SiluAndMul

__all__ = ["Attention", "RMSNorm", "RotaryEmbedding", "get_rope", "SiluAndMul"]
