"""``POST /v1/embeddings`` through ``hookllm serve`` with the real ``openai`` client, against
sentence-transformers on the same tiny checkpoint."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from server_fixtures import HOST, Server, free_port
from pooling_fixtures import sentence_transformer

TEXTS = ["hello world", "the quick brown fox", "x"]


@pytest.fixture(scope="module")
def embedding_server(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("st-mean")
    reference = sentence_transformer(tiny_llama_dir, folder, "mean", normalize=True)
    grpc_port = free_port()
    server = Server([str(folder), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64",
                     "--served-model-name", "embedder", "--grpc-port", str(grpc_port)])
    server.reference, server.grpc_port = reference, grpc_port
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(embedding_server):
    return openai.OpenAI(base_url=embedding_server.url + "/v1", api_key="none", timeout=60, max_retries=0)


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_embeddings_create_equals_sentence_transformers(embedding_server, client, encoding_format):
    response = client.embeddings.create(model="embedder", input=TEXTS, encoding_format=encoding_format)
    assert [item.index for item in response.data] == [0, 1, 2] and response.model == "embedder"
    got = torch.tensor([item.embedding for item in response.data]) if encoding_format == "float" else None
    if got is None:  # the client returns base64 as sent when it was asked for explicitly
        import base64
        import numpy as np
        got = torch.tensor(np.stack([np.frombuffer(base64.b64decode(item.embedding), dtype="<f4")
                                     for item in response.data]))
    torch.testing.assert_close(got, embedding_server.reference.encode(TEXTS, convert_to_tensor=True),
                               atol=1e-5, rtol=1e-5)
    assert response.usage.prompt_tokens == response.usage.total_tokens > len(TEXTS)


def test_token_id_input_embeds_as_its_text_does(client):
    ids = client.embeddings.create(model="embedder", input=[[5, 6, 7, 8]]).data[0].embedding
    again = client.embeddings.create(model="embedder", input=[5, 6, 7, 8]).data[0].embedding
    assert ids == again and len(ids) == 64


def test_dimensions_on_a_model_without_matryoshka_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        client.embeddings.create(model="embedder", input="hi", dimensions=8)


def test_a_generation_request_to_the_embedding_model_is_a_400_naming_its_runner(embedding_server):
    response = httpx.post(embedding_server.url + "/v1/completions",
                          json={"model": "embedder", "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert response.status_code == 400 and "pooling runner" in response.json()["error"]["message"]


def test_an_empty_input_list_is_a_400(embedding_server):
    response = httpx.post(embedding_server.url + "/v1/embeddings", json={"model": "embedder", "input": []},
                          timeout=60)
    assert response.status_code == 400


def test_grpc_embed_equals_the_http_embedding(embedding_server):
    from hookllm.grpc import vllm_engine_pb2 as pb2
    from hookllm.grpc_client import GrpcClient

    with GrpcClient(f"{HOST}:{embedding_server.grpc_port}", timeout=60) as client:
        reply = client.stub.Embed(pb2.EmbedRequest(tokenized=pb2.TokenizedInput(input_ids=[5, 6, 7, 8])), timeout=60)
    over_http = httpx.post(embedding_server.url + "/v1/embeddings", json={"input": [5, 6, 7, 8]}, timeout=60).json()
    assert reply.prompt_tokens == 4 and reply.embedding_dim == 64
    assert list(reply.embedding) == pytest.approx(over_http["data"][0]["embedding"], abs=1e-6)


def test_pooling_gives_every_tokens_hidden_state_or_the_embedding(embedding_server, tiny_llama_reference):
    ids = [5, 6, 7, 8]
    per_token = httpx.post(embedding_server.url + "/pooling", json={"input": [ids]}, timeout=60).json()["data"][0]
    with torch.no_grad():
        want = tiny_llama_reference.model(torch.tensor([ids])).last_hidden_state[0]
    assert per_token["object"] == "pooling"
    torch.testing.assert_close(torch.tensor(per_token["data"]), want, atol=1e-5, rtol=1e-5)
    embedded = httpx.post(embedding_server.url + "/pooling", json={"input": ids, "task": "embed"}, timeout=60).json()
    over_embeddings = httpx.post(embedding_server.url + "/v1/embeddings", json={"input": ids}, timeout=60).json()
    assert embedded["data"][0]["data"] == over_embeddings["data"][0]["embedding"]
