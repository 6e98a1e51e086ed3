"""Sentence-transformers models over the tests' tiny checkpoints: the pooling runner's reference."""

from __future__ import annotations

import torch


def sentence_transformer(base, folder, pooling_mode: str, normalize: bool, dense: list[int] = ()):
    """A sentence-transformers model over ``base``, saved to ``folder`` as hub checkpoints are;
    ``dense``: the output sizes of Dense modules after the pooling (Tanh, then Identity)."""
    from sentence_transformers import SentenceTransformer, models

    transformer = models.Transformer(str(base))
    transformer.tokenizer.pad_token = transformer.tokenizer.eos_token or transformer.tokenizer.unk_token
    size = transformer.get_word_embedding_dimension()
    modules = [transformer, models.Pooling(size, pooling_mode=pooling_mode)]
    torch.manual_seed(0)
    for index, out_features in enumerate(dense):
        activation = torch.nn.Tanh() if index == 0 else torch.nn.Identity()
        modules.append(models.Dense(size, out_features, activation_function=activation))
        size = out_features
    model = SentenceTransformer(modules=modules + ([models.Normalize()] if normalize else []), device="cpu")
    model.save(str(folder))
    return model
