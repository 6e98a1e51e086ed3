"""Native gpt-oss: sliding-window layers alternating with full ones, attention sinks, and experts
from the checkpoint's MXFP4 blocks (dequantized to the model dtype at load) or its bf16 variant."""

from hookllm import hookimpl


@hookimpl
def register_models(registry):
    registry.register("GptOssForCausalLM", "hookllm.adapters.gpt_oss.model:GptOssForCausalLM")


@hookimpl
def register_components(components):
    from hookllm.adapters.gpt_oss.mxfp4 import Mxfp4Method

    components.add_quantization_method("mxfp4", Mxfp4Method)
