"""The core's side of multimodal models (:class:`hookllm.plugins.contract.SupportsMultiModal`).

- :mod:`hookllm.multimodal.placeholders`: where the input processor's plugins put media items
  in a prompt (``preprocess_request``), one placeholder row per embedding row.
- :mod:`hookllm.multimodal.encoder_cache`: in the model runner, which rows of which items a step
  needs, the encoder run once per distinct item, its output kept while a live request uses it.
"""

from hookllm.multimodal.placeholders import content_hash, expand_placeholders

__all__ = ["content_hash", "expand_placeholders"]
