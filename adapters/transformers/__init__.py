"""The transformers modeling backend: every Hugging Face causal LM no other plugin serves.

It registers a fallback (:meth:`hookllm.plugins.registry.ModelRegistry.register_fallback`):
an architecture that no installed plugin registers by name is served by
:class:`hookllm.adapters.transformers.model.TransformersForCausalLM`, which runs transformers'
own modeling code on hookllm's paged attention; ``--model-impl transformers`` picks it for a
natively served architecture too. What it serves and refuses: docs/models.md.
"""

from importlib.metadata import version

from hookllm import hookimpl

MODEL_CLASS = "hookllm.adapters.transformers.model:TransformersForCausalLM"


def claims(architecture: str) -> bool:
    """:func:`.support.claims`, imported only when an architecture is looked up: importing
    transformers' model tables takes about a second, which every ``hookllm`` command would pay."""
    from hookllm.adapters.transformers import support

    return support.claims(architecture)


@hookimpl
def register_models(registry):
    registry.register_fallback(
        MODEL_CLASS, claims,
        description=f"every other causal LM transformers {version('transformers')} implements, or any with "
                    "--model-impl transformers; it refuses what it cannot run (encoders, state-space models...) "
                    "saying why")
