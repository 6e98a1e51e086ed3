"""The Llama-family adapter: Llama, Mistral, Qwen2 and Qwen3 decoders, and EAGLE-3 heads for them
(``speculative_config`` ``method`` ``eagle3``)."""

from hookllm import hookimpl

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"  # the published heads' config.json names it so


@hookimpl
def register_models(registry):
    for arch in ARCHITECTURES:
        registry.register(arch, f"hookllm.adapters.llama.model:{arch}")
    registry.register(EAGLE3_ARCHITECTURE, "hookllm.adapters.llama.eagle3:Eagle3LlamaForCausalLM")
