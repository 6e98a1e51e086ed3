"""What a request names its adapter by: vLLM's ``LoRARequest`` (``lora_name``, ``lora_int_id``,
``lora_path``), plain data that crosses to the engine core and the workers."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True):
    """A LoRA adapter for a request: a PEFT folder (``adapter_config.json`` and
    ``adapter_model.safetensors``) at ``lora_path``.

    ``lora_int_id`` identifies the adapter's weights: requests with the same id share a slot
    and cached KV blocks, so two different adapters must never share one (the server gives
    each adapter it loads a new id). ``base_model_name``, when given, must name the engine's
    model (vLLM's JSON ``--lora-modules`` form)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_int_id must be an int >= 1, "
                             f"got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_path is empty (a PEFT adapter folder)")
