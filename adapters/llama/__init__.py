"""The Llama-family adapter: Llama, Mistral, Qwen2 and Qwen3 decoders."""

from hookllm import hookimpl

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@hookimpl
def register_models(registry):
    for arch in ARCHITECTURES:
        registry.register(arch, f"hookllm.adapters.llama.model:{arch}")
