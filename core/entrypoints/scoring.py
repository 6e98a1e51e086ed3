"""What ``LLM.score`` and the server's ``/score`` and ``/rerank`` share: pairing the texts and
choosing how a model scores a pair (a cross-encoder reads both texts at once; an embedding
model compares their embeddings)."""

from __future__ import annotations

from typing import Any, Sequence

from hookllm.outputs import PoolingRequestOutput
from hookllm.pooling_params import PoolerConfig


def pair_texts(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> tuple[list[str], list[str]]:
    """The pairs to score: one ``text_1`` against every ``text_2``, or two lists of one length."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds) or not seconds:
        raise ValueError(f"score takes one text_1 or as many as text_2: got {len(firsts)} and {len(seconds)}")
    return firsts, seconds


def is_cross_encoder(pooler: PoolerConfig | None, model: str) -> bool:
    """Whether the model scores a pair itself (a classifier of one label) rather than through
    embeddings; ``ValueError`` for a classifier of several labels, which does neither."""
    if pooler is None or not pooler.is_classifier:
        return False
    if len(pooler.labels) != 1:
        raise ValueError(f"scoring needs a cross-encoder (a classifier of one label) or an embedding model; "
                         f"{model} is a classifier of {len(pooler.labels)} labels: use classify")
    return True


def pair_scores(outputs: list[PoolingRequestOutput], cross_encoder: bool) -> list[float]:
    """Each pair's score from its pooling outputs: a cross-encoder's one per pair (the ``score``
    task's probability); an embedding model's two per pair, the firsts then the seconds
    (normalized embeddings: their dot product is the cosine)."""
    if cross_encoder:
        return [float(output.outputs.data[0]) for output in outputs]
    half = len(outputs) // 2
    return [float(first.outputs.data @ second.outputs.data) for first, second in zip(outputs[:half], outputs[half:])]


def pair_prompts(tokenizer: Any, firsts: list[str], seconds: list[str]) -> list[dict[str, list[int]]]:
    """Each pair as the tokenizer joins two texts (its pair template), for a cross-encoder, with
    the token types a BERT-style tokenizer gives the second text."""
    prompts = []
    for first, second in zip(firsts, seconds):
        encoded = tokenizer(first, second)
        prompt = {"prompt_token_ids": encoded["input_ids"]}
        if any(encoded.get("token_type_ids") or ()):
            prompt["token_type_ids"] = encoded["token_type_ids"]
        prompts.append(prompt)
    return prompts
