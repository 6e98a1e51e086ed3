"""FP8 (e4m3) weights, on the quantization contract (:mod:`hookllm.plugins.quantization`).

Serves the hub's FP8 checkpoints, ``quant_method: fp8`` (block-wise scales) and
``compressed-tensors`` (per-tensor, per-channel or block scales; dynamic, static or no
activation scales; optional K/V scales), and ``--quantization fp8`` on an unquantized one
(per-channel scales computed at load). It is found by the checkpoint's ``quant_method`` or the
flag: no ``--plugin`` needed. The FP8 KV cache (``--kv-cache-dtype fp8``) is the core's; this
plugin hands it the checkpoint's K/V scales. docs/quantization.md has the details.
"""

from hookllm import hookimpl
from hookllm.plugins.components import Components


@hookimpl
def register_components(components: Components) -> None:
    from hookllm.bundled.fp8.method import CompressedTensorsMethod, Fp8Method

    components.add_quantization_method("fp8", Fp8Method)
    components.add_quantization_method("compressed-tensors", CompressedTensorsMethod)
