"""``hookllm serve`` on the default SmolLM2 model and on a tiny LLaVA with ``--plugin llava``."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
from llava_fixtures import checkpoint, random_image  # noqa: F401 - checkpoint is a fixture

from hookllm import LLM, SamplingParams
from server_fixtures import Server, with_chat_template

LLAVA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }} {% endfor %}"
                  "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
IMAGE = random_image(40, 30, seed=1)


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def llava_dir(checkpoint, tmp_path_factory):  # noqa: F811
    return with_chat_template(checkpoint, tmp_path_factory.mktemp("llava-chat") / "model", LLAVA_TEMPLATE)


@pytest.fixture(scope="module")
def llava_server(llava_dir, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    IMAGE.save(media / "cat.png")
    server = Server([str(llava_dir), "--plugin", "llava", "--device", "cpu", "--dtype", "float32",
                     "--num-kv-blocks", "32", "--served-model-name", "llava", "--allowed-local-media-path",
                     str(media)])
    server.media = media
    yield server
    assert server.stop() == 0


def image_message(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is this?"}]}]


def test_llava_chat_with_an_image_equals_offline_chat(llava_server, llava_dir):
    offline = LLM(str(llava_dir), plugins=["llava"], device="cpu", dtype="float32", num_kv_blocks=32)
    expected = offline.chat(image_message(data_url(IMAGE)), SamplingParams(max_tokens=8, temperature=0))[0]
    client = openai.OpenAI(base_url=llava_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    for url in (data_url(IMAGE), (llava_server.media / "cat.png").as_uri()):
        response = client.chat.completions.create(model="llava", messages=image_message(url), max_tokens=8,
                                                  temperature=0)
        assert response.choices[0].message.content == expected.outputs[0].text
        assert response.usage.prompt_tokens == len(expected.prompt_token_ids)


@pytest.mark.parametrize("url", ["data:image/png;base64,bm90IGFuIGltYWdl", "file:///etc/hostname",
                                 "file://{media}/../outside.png"], ids=["undecodable", "outside", "dot-dot"])
def test_llava_bad_image_is_a_400_and_the_server_serves_on(llava_server, url):
    client = openai.OpenAI(base_url=llava_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="llava", messages=image_message(url.format(media=llava_server.media)),
                                       max_tokens=4, temperature=0)
    response = client.chat.completions.create(model="llava", messages=image_message(data_url(IMAGE)), max_tokens=2)
    assert response.choices[0].finish_reason == "length"
    assert llava_server.metric("hookllm:num_used_kv_blocks") == 0


@pytest.fixture(scope="module")
def default_server():
    server = Server(["--device", "cpu", "--dtype", "float32"])
    yield server
    assert server.stop() == 0


def test_default_smollm2_answers_paris(default_server):
    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0)
    assert "Paris" in response.choices[0].message.content


def test_default_model_is_served_by_its_short_name_not_its_cache_path(default_server):
    from hookllm.hub.default_model import MODEL_NAME, cache_dir

    models = httpx.get(default_server.url + "/v1/models").json()["data"]
    assert [(m["id"], m["root"]) for m in models] == [(MODEL_NAME, MODEL_NAME)]
    assert str(cache_dir()) not in httpx.get(default_server.url + "/metrics").text
