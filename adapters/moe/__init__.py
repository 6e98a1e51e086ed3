"""Native mixture-of-experts decoders: Qwen2-MoE (with its shared expert), Qwen3-MoE and Mixtral."""

from hookllm import hookimpl

ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")


@hookimpl
def register_models(registry):
    for arch in ARCHITECTURES:
        registry.register(arch, f"hookllm.adapters.moe.model:{arch}")
