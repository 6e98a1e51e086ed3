"""hookllm plugin: serves ``GPT2LMHeadModel`` checkpoints. Only registers the class; the core loads it."""

from hookllm import hookimpl


@hookimpl
def register_models(registry):
    registry.register("GPT2LMHeadModel", "hookllm_gpt2.model:GPT2LMHeadModel")
