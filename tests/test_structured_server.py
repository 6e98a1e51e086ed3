"""Structured output through the OpenAI server: ``response_format`` and vLLM's ``structured_outputs``."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from hookllm.config import EngineConfig
from server_fixtures import Server, with_chat_template

pytest.importorskip("llguidance")

SCHEMA = {  # completes in a few tokens even on the tiny random model
    "type": "object",
    "x-guidance": {"whitespace_flexible": False},
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "integer", "minimum": 0,
                                                                          "maximum": 99}},
    "required": ["color", "size"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def chat_model_dir(tiny_llama_dir, tmp_path_factory):
    return with_chat_template(tiny_llama_dir, tmp_path_factory.mktemp("structured-chat") / "model")


@pytest.fixture(scope="module")
def client(chat_model_dir):
    server = Server([str(chat_model_dir), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64",
                     "--served-model-name", "x", "--plugin", "structured"])
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert server.stop() == 0


def test_response_format_json_schema_returns_valid_json(client):
    for seed in range(4):
        reply = client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "A color as JSON"}], temperature=1.0, seed=seed,
            max_tokens=40, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
        jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)


def test_response_format_json_object_returns_an_object(client):
    reply = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "JSON"}], temperature=0.0, max_tokens=48,
        response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # cut at max_tokens: still a prefix of an object
        assert reply.choices[0].message.content.lstrip().startswith("{")


def test_vllm_structured_outputs_body_field(client):
    reply = client.completions.create(model="x", prompt="Answer:", max_tokens=8, temperature=1.0, seed=3,
                                      extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert reply.choices[0].text in ("alpha", "beta")
    reply = client.completions.create(model="x", prompt="Code:", max_tokens=16, temperature=1.0, seed=3,
                                      extra_body={"structured_outputs": {"regex": r"[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{4}", reply.choices[0].text)


def test_an_invalid_schema_is_a_400_and_the_server_keeps_serving(client):
    with pytest.raises(openai.BadRequestError, match="structured_outputs.regex"):
        client.completions.create(model="x", prompt="x", max_tokens=4, extra_body={"structured_outputs": {"regex": "a("}})
    with pytest.raises(openai.BadRequestError, match="exactly one of"):
        client.completions.create(model="x", prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}})
    assert client.completions.create(model="x", prompt="x", max_tokens=2).choices[0].text is not None


def test_response_format_without_a_plugin_that_enforces_it_is_a_400(chat_model_dir):
    from hookllm.engine.async_llm import AsyncLLM
    from hookllm.server.app import ServerSettings, build_app

    async def post() -> httpx.Response:
        engine = AsyncLLM.from_engine_config(EngineConfig(str(chat_model_dir), device="cpu", dtype="float32",
                                                          num_kv_blocks=16))
        try:
            app = build_app(engine, ServerSettings(served_model_names=["x"]))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as http:
                return await http.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}})
        finally:
            engine.shutdown()

    response = asyncio.run(post())
    assert response.status_code == 400
    error = response.json()["error"]
    assert re.search("structured_outputs|response_format", error["message"])
