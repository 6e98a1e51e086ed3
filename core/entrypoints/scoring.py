"""What ``LLM.score`` and the server's ``/score`` and ``/rerank`` share: pairing the texts and
choosing how a model scores a pair: a cross-encoder reads both texts at once; a late-interaction
model (ColBERT) matches each token of the first text with its best match in the second; an
embedding model compares their embeddings."""

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


CROSS_ENCODER, LATE_INTERACTION, EMBEDDINGS = "cross-encoder", "late-interaction", "embeddings"


def score_method(pooler: PoolerConfig | None, model: str) -> str:
    """How the model scores a pair: ``CROSS_ENCODER`` (a classifier of one label),
    ``LATE_INTERACTION`` (its checkpoint projects each token for MaxSim) or ``EMBEDDINGS``;
    ``ValueError`` for a classifier of several labels, which does none of them."""
    if pooler is not None and pooler.late_interaction:
        return LATE_INTERACTION
    if pooler is None or not pooler.is_classifier:
        return EMBEDDINGS
    if len(pooler.labels) != 1:
        raise ValueError(f"scoring needs a cross-encoder (a classifier of one label) or an embedding model; "
                         f"{model} is a classifier of {len(pooler.labels)} labels: use classify")
    return CROSS_ENCODER


def score_inputs(method: str, tokenizer: Any, firsts: list[str], seconds: list[str]) -> tuple[list, dict[str, Any]]:
    """What to pool for the pairs, and the ``PoolingParams`` fields it takes: a cross-encoder's
    pairs joined by the tokenizer (the ``score`` task); else the firsts then the seconds, each
    alone (a late-interaction model's token embeddings, or normalized embeddings)."""
    if method == CROSS_ENCODER:
        return pair_prompts(tokenizer, firsts, seconds), {"task": "score"}
    if method == LATE_INTERACTION:
        return firsts + seconds, {"task": "encode"}
    return firsts + seconds, {"task": "embed", "normalize": True}


def pair_scores(outputs: list[PoolingRequestOutput], method: str) -> list[float]:
    """Each pair's score from the outputs of :func:`score_inputs`' prompts: a cross-encoder's
    probability; a late-interaction model's MaxSim (for each token of the first text, its best
    dot product with a token of the second, summed); the cosine of two normalized embeddings."""
    if method == CROSS_ENCODER:
        return [float(output.outputs.data[0]) for output in outputs]
    half = len(outputs) // 2
    pairs = zip(outputs[:half], outputs[half:])
    if method == LATE_INTERACTION:
        return [float((first.outputs.data @ second.outputs.data.T).max(dim=1).values.sum()) for first, second in pairs]
    return [float(first.outputs.data @ second.outputs.data) for first, second in pairs]


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
