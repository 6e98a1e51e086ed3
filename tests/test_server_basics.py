"""What every ``hookllm serve`` shows before any request: the model's name (a hub id, or a
folder's name: never a path), errors in OpenAI's shape on every path, and the engine's gauges.

One server, on a model given as a hub id and read from a hub cache made here (offline).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from hookllm.hub import short_model_name
from hookllm.server.errors import add_error_handlers
from server_fixtures import Server

HUB_ID = "tiny-org/tiny-llama"
NUM_KV_BLOCKS = 24


@pytest.fixture(scope="module")
def hub_cache(tiny_llama_dir, tmp_path_factory) -> Path:
    """A hub cache holding the tiny Llama as ``HUB_ID`` (the layout huggingface_hub reads)."""
    cache = tmp_path_factory.mktemp("hub-cache")
    repo = cache / ("models--" + HUB_ID.replace("/", "--"))
    shutil.copytree(tiny_llama_dir, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return cache


@pytest.fixture(scope="module")
def server(hub_cache):
    with pytest.MonkeyPatch.context() as env:  # the server process inherits them
        env.setenv("HF_HUB_CACHE", str(hub_cache))
        env.setenv("HF_HUB_OFFLINE", "1")
        server = Server([HUB_ID, "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", str(NUM_KV_BLOCKS)])
    yield server
    assert server.stop() == 0


def test_engine_gauges_are_right_before_any_request(server):
    assert server.metric("hookllm:num_kv_blocks") == NUM_KV_BLOCKS
    assert server.metric("hookllm:num_used_kv_blocks") == 0
    assert server.metric("hookllm:kv_cache_usage_perc") == 0
    assert server.metric("hookllm:num_requests_running") == 0


def test_served_name_defaults_to_the_hub_id_as_typed_and_models_lists_it(server, hub_cache):
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert [(m["id"], m["root"]) for m in models] == [(HUB_ID, HUB_ID)]
    assert server.metric("hookllm:num_kv_blocks", f'model_name="{HUB_ID}"') == NUM_KV_BLOCKS
    assert str(hub_cache) not in httpx.get(server.url + "/metrics").text
    tokens = httpx.post(server.url + "/tokenize", json={"model": HUB_ID, "prompt": "Hello"})
    assert tokens.status_code == 200


@pytest.mark.parametrize("model, name", [(HUB_ID, HUB_ID), ("/srv/models/llama-3/", "llama-3"),
                                         ("models/../llama-3", "llama-3")],
                         ids=["hub-id", "absolute-folder", "relative-folder"])
def test_short_model_name_is_the_hub_id_or_the_folder_name_never_a_path(model, name):
    assert short_model_name(model) == name


def test_unknown_route_is_an_openai_404(server):
    for method in ("GET", "POST"):
        response = httpx.request(method, server.url + "/v1/nope")
        assert response.status_code == 404
        assert response.json() == {"error": {"message": f"Not Found ({method} /v1/nope)",
                                              "type": "invalid_request_error", "param": None, "code": 404}}


def test_wrong_method_is_an_openai_405(server):
    response = httpx.get(server.url + "/v1/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json() == {"error": {"message": "Method Not Allowed (GET /v1/completions)",
                                          "type": "invalid_request_error", "param": None, "code": 405}}


def test_an_unexpected_exception_is_an_openai_500_without_its_message():
    app = FastAPI()
    add_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise FileNotFoundError("/secret/weights.bin")

    response = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert response.status_code == 500
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", 500)
    assert "FileNotFoundError" in error["message"] and "/secret" not in error["message"]
