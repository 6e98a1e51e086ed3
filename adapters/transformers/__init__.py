"""The transformers modeling backend: every Hugging Face causal LM and encoder no other plugin serves.

It registers a fallback (:meth:`hookllm.plugins.registry.ModelRegistry.register_fallback`):
an architecture that no installed plugin registers by name is served by
:class:`hookllm.adapters.transformers.model.TransformersForCausalLM` (a decoder) or
:class:`hookllm.adapters.transformers.encoder.TransformersEncoderModel` (an encoder, for the
pooling runner), which run transformers' own modeling code on hookllm's paged attention;
``--model-impl transformers`` picks it for a natively served architecture too. What it serves
and refuses: docs/models.md.
"""

from importlib.metadata import version

from hookllm import hookimpl

CAUSAL_LM_CLASS = "hookllm.adapters.transformers.model:TransformersForCausalLM"
ENCODER_CLASS = "hookllm.adapters.transformers.encoder:TransformersEncoderModel"


def claims(architecture: str) -> bool:
    """:func:`.support.claims`, imported only when an architecture is looked up: importing
    transformers' model tables takes about a second, which every ``hookllm`` command would pay."""
    from hookllm.adapters.transformers import support

    return support.claims(architecture)


def model_class(architecture: str) -> str:
    """The backend's class for ``architecture``: the encoder's for a model type transformers gives
    a masked LM (BERT, RoBERTa, ModernBERT...), else the causal LM's."""
    from hookllm.adapters.transformers import support

    return ENCODER_CLASS if support.is_encoder_architecture(architecture) else CAUSAL_LM_CLASS


@hookimpl
def register_models(registry):
    registry.register_fallback(
        model_class, claims,
        description=f"every other causal LM and encoder transformers {version('transformers')} implements, or "
                    "any with --model-impl transformers; it refuses what it cannot run (state-space models, "
                    "encoder-decoders...) saying why")
