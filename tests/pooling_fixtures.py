"""Sentence-transformers models over the tests' tiny checkpoints: the pooling runner's reference."""

from __future__ import annotations


def sentence_transformer(base, folder, pooling_mode: str, normalize: bool):
    """A sentence-transformers model over ``base``, saved to ``folder`` as hub checkpoints are."""
    from sentence_transformers import SentenceTransformer, models

    transformer = models.Transformer(str(base))
    transformer.tokenizer.pad_token = transformer.tokenizer.eos_token or transformer.tokenizer.unk_token
    modules = [transformer, models.Pooling(transformer.get_word_embedding_dimension(), pooling_mode=pooling_mode)]
    model = SentenceTransformer(modules=modules + ([models.Normalize()] if normalize else []), device="cpu")
    model.save(str(folder))
    return model
