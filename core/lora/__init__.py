"""LoRA adapters served over one base model, many in one batch (Punica / S-LoRA style).

- :mod:`hookllm.lora.request`: ``LoRARequest``, what a request names its adapter by (vLLM's).
- :mod:`hookllm.lora.adapter`: a PEFT folder read and checked against the base model.
- :mod:`hookllm.lora.layers`: the base model's projections with per-row adapter deltas.
- :mod:`hookllm.lora.manager`: the worker's adapter slots on the device, loaded on demand and
  evicted least recently used, and each step's rows-to-slot mapping.

See docs/lora.md.
"""
