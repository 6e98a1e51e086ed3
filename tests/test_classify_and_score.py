"""Classification and scoring on the pooling runner: a ``*ForSequenceClassification`` decoder's
probabilities and a cross-encoder's pair scores against transformers on the same tiny random
checkpoint; an embedding model's scores are its embeddings' cosine similarity."""

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from hookllm import LLM, PoolingParams, testing

PROMPTS = [[5, 6, 7], list(range(3, 60)), [9]]


def classifier_dir(tmp_path_factory, tiny_llama_dir, num_labels: int):
    path = tmp_path_factory.mktemp(f"classifier-{num_labels}")
    config = testing.tiny_llama_config(num_labels=num_labels, pad_token_id=0)
    testing.build_tiny_checkpoint(config, path, model_cls=AutoModelForSequenceClassification)
    testing.build_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def three_labels(tmp_path_factory, tiny_llama_dir):
    return classifier_dir(tmp_path_factory, tiny_llama_dir, 3)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, tiny_llama_dir):
    return classifier_dir(tmp_path_factory, tiny_llama_dir, 1)


def reference_logits(path, prompt: list[int]) -> torch.Tensor:
    model = testing.load_reference(path, AutoModelForSequenceClassification)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def test_classify_gives_the_heads_probabilities_as_transformers(three_labels):
    llm = LLM(str(three_labels), dtype="float32", device="cpu", max_num_batched_tokens=16)  # chunked prompts
    outputs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS])
    for output, prompt in zip(outputs, PROMPTS):
        want = reference_logits(three_labels, prompt).softmax(dim=-1)
        assert output.outputs.num_classes == 3
        torch.testing.assert_close(torch.tensor(output.outputs.probs), want, atol=1e-5, rtol=1e-5)
    raw = llm.classify([{"prompt_token_ids": PROMPTS[0]}], PoolingParams(activation=False))[0].outputs.probs
    torch.testing.assert_close(torch.tensor(raw), reference_logits(three_labels, PROMPTS[0]), atol=1e-5, rtol=1e-5)


def test_a_cross_encoder_scores_each_pair_as_transformers(cross_encoder):
    llm = LLM(str(cross_encoder), dtype="float32", device="cpu")
    tokenizer = llm.get_tokenizer()
    query, documents = "what is a fox", ["a fox is an animal", "the sky is blue", "x"]
    scores = llm.score(query, documents)
    for output, document in zip(scores, documents):
        want = reference_logits(cross_encoder, tokenizer(query, document)["input_ids"]).sigmoid()[0]
        assert abs(output.outputs.score - float(want)) < 1e-5


def test_an_embedding_models_score_is_the_cosine_of_its_embeddings(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", runner="pooling")
    [score] = llm.score("a fox", "an animal")
    first, second = (torch.tensor(o.outputs.embedding) for o in llm.embed(["a fox", "an animal"]))
    assert abs(score.outputs.score - float(first @ second)) < 1e-5


def test_score_refuses_lists_of_unequal_length(cross_encoder):
    llm = LLM(str(cross_encoder), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="one text_1 or as many as text_2"):
        llm.score(["a", "b"], ["c", "d", "e"])


def test_classify_on_a_model_without_a_head_names_what_it_needs(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", runner="pooling")
    with pytest.raises(ValueError, match="needs a classification head"):
        llm.classify(["hi"])
