"""``hookllm serve`` under schemathesis, a fuzzer that generates requests from the server's own
OpenAPI document (/openapi.json): every operation answers each one with a 2xx or a 4xx, never a
5xx, as the document says. Then the fixes the fuzzer led to, each on its own: logprobs that are no
finite number (written -9999.0, as vLLM does), and a document whose request schemas refuse what
the server refuses and whose errors are the 400s the server answers (FastAPI's default says 422).

One server for the module, on the tiny Llama with a short ``--max-model-len`` so that generated
requests (``max_tokens`` and ``n`` up to their maximums) finish fast.
"""

from __future__ import annotations

import math
from datetime import timedelta

import httpx
import jsonschema
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from hookllm import LLM, SamplingParams
from server_fixtures import Server, with_chat_template

MAX_MODEL_LEN = 64
NUM_KV_BLOCKS = 64
CONVERSATION = [{"role": "user", "content": "hi"}]
# The requests the fuzzer found crashing the JSON encoding: a penalty that overflows the logits
# (NaN logprobs), and a single allowed token (every other one -inf).
NON_FINITE = {"nan": {"repetition_penalty": 5e-324, "num_top": 1},
              "minus-inf": {"allowed_token_ids": [0], "num_top": 19}}


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, tmp_path_factory):
    return with_chat_template(tiny_llama_dir, tmp_path_factory.mktemp("fuzz-llama") / "model")


@pytest.fixture(scope="module")
def server(model_dir):
    server = Server([str(model_dir), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", str(NUM_KV_BLOCKS),
                     "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny"])
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def document(server):
    return httpx.get(server.url + "/openapi.json", timeout=10).json()


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE],
                         ids=["valid", "invalid"])
def test_every_operation_answers_generated_requests_as_documented_and_never_with_a_server_error(
        api_schema, mode):
    """Requests generated from /openapi.json, valid ones or ones the schema refuses, for every
    operation (a few per operation, derandomized, so that the test stays short and reproducible);
    streamed answers are checked for their status and content type (their events have no schema).

    Left out: schemathesis' ``positive_data_acceptance``: valid requests the server still refuses
    with a 400 for what no static schema can state (an unknown model name, token ids past the
    vocabulary, a prompt longer than the context, an empty text prompt when the tokenizer adds no
    BOS token, fields that are neither declared nor a plugin's option)."""
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    for operation in (result.ok() for result in api_schema.get_all_operations()):
        if mode is schemathesis.GenerationMode.NEGATIVE and not len(operation.body):
            continue  # nothing to make invalid: no body (a path's string parameter takes any value)
        @settings(max_examples=15, deadline=timedelta(seconds=30), derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def answered_as_documented(case: schemathesis.Case) -> None:
            case.call_and_validate(checks=checks, timeout=60)

        answered_as_documented()  # a failure names the request (its curl command) and the check it failed


def json_logprob(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else -9999.0


def offline_logprobs(output, num_top: int) -> list[tuple[float, list[float]]]:
    """Each generated token's logprob and its ``num_top`` best alternatives' as the server should write them."""
    return [(json_logprob(entry[token_id].logprob),
             sorted((json_logprob(lp.logprob) for lp in entry.values()), reverse=True)[:num_top])
            for token_id, entry in zip(output.token_ids, output.logprobs)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", NON_FINITE, ids=list(NON_FINITE))
def test_non_finite_completion_logprobs_are_written_as_minus_9999(client, offline, case, stream):
    fields = dict(NON_FINITE[case])
    num_top = fields.pop("num_top")
    output = offline.generate("hi", SamplingParams(max_tokens=2, temperature=0, logprobs=num_top, **fields))[0]
    expected = offline_logprobs(output.outputs[0], num_top)
    assert any(-9999.0 in [value, *top] for value, top in expected)  # the case has a value to write so
    reply = client.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0, logprobs=num_top,
                                      stream=stream, extra_body=fields)
    got = []
    for choice in ([chunk.choices[0] for chunk in reply] if stream else reply.choices):
        for value, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs):
            got.append((value, sorted(top.values(), reverse=True)))
    assert got == expected


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", NON_FINITE, ids=list(NON_FINITE))
def test_non_finite_chat_logprobs_are_written_as_minus_9999(client, offline, case, stream):
    fields = dict(NON_FINITE[case])
    num_top = fields.pop("num_top")
    output = offline.chat(CONVERSATION, SamplingParams(max_tokens=2, temperature=0, logprobs=num_top, **fields))[0]
    expected = offline_logprobs(output.outputs[0], num_top)
    assert any(-9999.0 in [value, *top] for value, top in expected)  # the case has a value to write so
    reply = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=2, temperature=0,
                                           logprobs=True, top_logprobs=num_top, stream=stream, extra_body=fields)
    got = []
    for choice in ([chunk.choices[0] for chunk in reply] if stream else reply.choices):
        for token in (choice.logprobs.content if choice.logprobs else []):
            got.append((token.logprob, sorted((top.logprob for top in token.top_logprobs), reverse=True)))
    assert got == expected


def test_openapi_documents_validation_errors_as_the_400_the_server_answers(document, server):
    operations = [(path, method, operation) for path, methods in document["paths"].items()
                  for method, operation in methods.items()]
    assert all("422" not in operation["responses"] for _, _, operation in operations)
    for path, method, operation in operations:
        if "requestBody" in operation:
            error = operation["responses"]["400"]["content"]["application/json"]["schema"]
            assert error == {"$ref": "#/components/schemas/ErrorResponse"}, (method, path)
    assert len({operation["operationId"] for _, _, operation in operations}) == len(operations)
    answer = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": "many"}, timeout=30)
    assert answer.status_code == 400
    jsonschema.validate(answer.json(), {"$ref": "#/components/schemas/ErrorResponse", **document})


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [], "max_tokens": 1}),
    ("/v1/completions", {"prompt": [[]], "max_tokens": 1}),
    ("/v1/completions", {"prompt": [-1], "max_tokens": 1}),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": CONVERSATION, "top_logprobs": 2, "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": CONVERSATION, "top_logprobs": 2, "logprobs": True, "max_tokens": 1}),
    ("/tokenize", {"messages": []}),
    ("/tokenize", {}),
    ("/tokenize", {"prompt": "hi", "messages": CONVERSATION}),
    ("/tokenize", {"prompt": "hi", "messages": None}),
    ("/detokenize", {"tokens": [-1]}),
    ("/detokenize", {"tokens": [5]}),
], ids=["empty-prompt-list", "empty-token-ids", "negative-token-id", "token-ids", "top-logprobs-without-logprobs",
        "top-logprobs-with-logprobs", "tokenize-no-messages", "tokenize-neither", "tokenize-both",
        "tokenize-prompt", "detokenize-negative-id", "detokenize"])
def test_documented_request_schema_refuses_what_the_server_refuses(document, server, path, body):
    reference = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    valid = jsonschema.Draft202012Validator({"$ref": reference, **document}).is_valid(body)
    answer = httpx.post(server.url + path, json=body, timeout=30)
    assert answer.status_code == (200 if valid else 400), answer.text


@pytest.mark.parametrize("prompt, param, problem", [
    ([], "prompt", "List should have at least 1 item"),
    ([[1], [-2]], "prompt.1.0", "Input should be greater than or equal to 0"),
], ids=["empty-list", "negative-token-id"])
def test_a_prompt_that_no_form_of_it_takes_is_a_400_naming_what_is_wrong(server, prompt, param, problem):
    """A value every member of ``prompt``'s union refuses: the error is the member of its type's
    (a list too short, not "Input should be a valid string"), its param the body's path."""
    answer = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=30)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: {problem}")
