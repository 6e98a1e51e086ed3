"""``/score``, ``/rerank`` (and ``/v1/rerank``) and ``/classify`` through ``hookllm serve`` on a
tiny cross-encoder (a one-label ``LlamaForSequenceClassification``), against transformers."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from hookllm import testing
from server_fixtures import Server

QUERY = "what is a fox"
DOCUMENTS = ["a fox is an animal", "the sky is blue", "x", "foxes live in dens"]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("cross-encoder")
    testing.build_tiny_checkpoint(testing.tiny_llama_config(num_labels=1, pad_token_id=0), path,
                                  model_cls=AutoModelForSequenceClassification)
    testing.build_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def server(cross_encoder):
    server = Server([str(cross_encoder), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64",
                     "--served-model-name", "reranker"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference_scores(cross_encoder) -> list[float]:
    model = testing.load_reference(cross_encoder, AutoModelForSequenceClassification)
    tokenizer = AutoTokenizer.from_pretrained(str(cross_encoder))
    with torch.no_grad():
        return [float(model(torch.tensor([tokenizer(QUERY, document)["input_ids"]])).logits[0, 0].sigmoid())
                for document in DOCUMENTS]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "reranker", **body}, timeout=60)


def test_score_gives_each_pair_the_reference_probability(server, reference_scores):
    response = post(server, "/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [item["index"] for item in response["data"]] == [0, 1, 2, 3]
    assert [item["score"] for item in response["data"]] == pytest.approx(reference_scores, abs=1e-5)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank"])
def test_rerank_returns_the_documents_best_first(server, reference_scores, path):
    response = post(server, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 3}).json()
    order = sorted(range(len(DOCUMENTS)), key=lambda i: reference_scores[i], reverse=True)[:3]
    assert [result["index"] for result in response["results"]] == order
    assert [result["document"]["text"] for result in response["results"]] == [DOCUMENTS[i] for i in order]
    assert [result["relevance_score"] for result in response["results"]] == pytest.approx(
        [reference_scores[i] for i in order], abs=1e-5)


def test_classify_names_the_label_and_its_probability(server, reference_scores, cross_encoder):
    tokenizer = AutoTokenizer.from_pretrained(str(cross_encoder))
    pair = tokenizer(QUERY, DOCUMENTS[0])["input_ids"]
    [item] = post(server, "/classify", {"input": [pair]}).json()["data"]
    assert item["label"] == "LABEL_0" and item["num_classes"] == 1
    assert item["probs"] == pytest.approx([reference_scores[0]], abs=1e-5)


def test_score_with_lists_of_unequal_length_is_a_400(server):
    response = post(server, "/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert response.status_code == 400 and "text_1" in response.json()["error"]["message"]


def test_embeddings_from_a_model_without_a_pipeline_name_the_missing_parts(server):
    response = post(server, "/v1/embeddings", {"input": "hi", "dimensions": 4})
    assert response.status_code == 400 and "Matryoshka" in response.json()["error"]["message"]


def test_rerank_on_a_bert_cross_encoder_reads_each_pair_with_its_token_types(tmp_path):
    from sentence_transformers import CrossEncoder
    from transformers import BertConfig

    config = BertConfig(vocab_size=testing.WORDPIECE_VOCAB_SIZE, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=64, num_labels=1,
                        initializer_range=0.05)
    testing.build_tiny_checkpoint(config, tmp_path, model_cls=AutoModelForSequenceClassification)
    testing.build_tiny_wordpiece_tokenizer(tmp_path)
    query, documents = "what is the capital of france", ["paris is the capital", "the lazy dog", "x y z"]
    want = CrossEncoder(str(tmp_path), device="cpu").predict([(query, document) for document in documents]).tolist()
    server = Server([str(tmp_path), "--device", "cpu", "--dtype", "float32", "--served-model-name", "reranker"])
    try:
        results = post(server, "/rerank", {"query": query, "documents": documents}).json()["results"]
    finally:
        server.stop()
    order = sorted(range(len(documents)), key=lambda i: want[i], reverse=True)
    assert [result["index"] for result in results] == order
    assert [result["relevance_score"] for result in results] == pytest.approx([want[i] for i in order], abs=1e-5)
