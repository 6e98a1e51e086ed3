"""Every class of error the server answers has OpenAI's shape, ``{"error": {"message", "type",
"param", "code"}}``, with the ``type`` word OpenAI's API uses for its status (docs/serving.md):
checked through the real ``openai`` client, whose exception class follows from the status.

One server, with an API key and a plugin that fails the engine step of a request asking for it.
"""

from __future__ import annotations

import os
import textwrap
from typing import Callable

import openai
import pytest

from server_fixtures import Server

API_KEY = "sekrit"
# A plugin that raises in the engine step of a request with extra_args {"fail_step": true}: a 500.
FAILING_PLUGIN = """
from hookllm import hookimpl

@hookimpl
def process_logits(logits, batch):
    if any(r.sampling_params.extra_args.get("fail_step") for r in batch.sampling_requests):
        raise RuntimeError("this step was asked to fail")
"""


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    (site / "failstep_plugin.py").write_text(textwrap.dedent(FAILING_PLUGIN))
    dist_info = site / "failstep_plugin-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: failstep-plugin\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[hookllm.plugins]\nfailstep = failstep_plugin\n")
    with pytest.MonkeyPatch.context() as env:  # the server process finds the plugin on its path
        env.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
        env.delenv("HOOKLLM_PLUGINS", raising=False)
        server = Server([str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "16",
                         "--served-model-name", "tiny", "--api-key", API_KEY, "--plugin", "failstep"])
    yield server
    assert server.stop() == 0


def client(server: Server, api_key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=60)


def completion(**fields) -> Callable[[Server], object]:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, **fields}
    return lambda server: client(server).completions.create(**body)


# (what the client does, the exception the openai client raises, status, type, param, code):
# OpenAI answers each client error with invalid_request_error and its own failures with server_error.
CASES = {
    "400-bad-field": (completion(temperature=-1), openai.BadRequestError, 400, "invalid_request_error",
                      "temperature", 400),
    "401-wrong-key": (lambda server: client(server, "nope").models.list(), openai.AuthenticationError, 401,
                      "invalid_request_error", None, "invalid_api_key"),
    "404-unknown-model": (completion(model="nope"), openai.NotFoundError, 404, "invalid_request_error", "model",
                          "model_not_found"),
    "404-unknown-path": (lambda server: client(server).get("/nope", cast_to=object), openai.NotFoundError, 404,
                         "invalid_request_error", None, 404),
    "405-wrong-method": (lambda server: client(server).get("/completions", cast_to=object), openai.APIStatusError,
                         405, "invalid_request_error", None, 405),
    "500-failed-step": (completion(extra_body={"extra_args": {"fail_step": True}}), openai.InternalServerError, 500,
                        "server_error", None, 500),
}


@pytest.mark.parametrize("case", CASES)
def test_every_error_class_has_openais_shape_and_its_type_word(server, case):
    call, exception, status, type_, param, code = CASES[case]
    with pytest.raises(exception) as raised:
        call(server)
    error = raised.value
    assert error.status_code == status
    assert error.response.json() == {"error": error.body}
    assert set(error.body) == {"message", "type", "param", "code"} and error.body["message"]
    assert (error.body["type"], error.body["param"], error.body["code"]) == (type_, param, code)
