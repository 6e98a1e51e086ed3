"""The body fields that vLLM's and SGLang's clients and routers send, on one ``hookllm serve
--reasoning-parser qwen3`` subprocess: each is honoured as its server does (checked against the
offline ``LLM``, a pinned reply, or what the client counted), a field for something the server
does not do is a 400 naming it unless it asks for nothing, and a made-up field is still a 400.

The reasoning tests pin the tiny random model's reply with ``structured_outputs`` to a text
written as a Qwen3 model writes it. vllm-router runs for real in front of the server; guidellm
(too heavy to install for the tests: datasets, sanic, a click pin) is replayed from its bodies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from hookllm import LLM, SamplingParams
from server_fixtures import HOST, Server, free_port, with_chat_template

pytest.importorskip("llguidance")

NUM_KV_BLOCKS = 128
PROMPT = "Hello there"
MESSAGES = [{"role": "user", "content": "Say something"}]
THINKING = "<think>\nRainy.\n</think>\n\nIt rains."  # the pinned reply: its reasoning, then its answer
PINNED = {"structured_outputs": {"choice": [THINKING]}}
# What vllm-router 0.1.17 adds to every chat request it forwards (seen on the wire: it sends
# them whatever the client sent).
ROUTER_FIELDS = {"no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
                 "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
                 "return_hidden_states": False, "include_reasoning": True, "logprobs": False}


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, tmp_path_factory):
    return with_chat_template(tiny_llama_dir, tmp_path_factory.mktemp("compat-llama") / "model")


@pytest.fixture(scope="module")
def server(model_dir):
    server = Server([str(model_dir), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", str(NUM_KV_BLOCKS),
                     "--served-model-name", "tiny", "--reasoning-parser", "qwen3"])
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": "tiny", **body}, timeout=60)


def sse_chunks(server: Server, path: str, body: dict) -> list[dict]:
    """A streamed answer's chunks, read as raw server-sent events."""
    chunks = []
    with httpx.stream("POST", f"{server.url}{path}", json={"model": "tiny", "stream": True, **body},
                      timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def chat_prompt_ids(offline: LLM) -> list[int]:
    """The conversation as the server renders it: the template's text, tokenized as it is."""
    text = offline.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return offline.tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_no_stop_trim_keeps_the_stop_string_as_include_stop_str_in_output(server, offline, path):
    chat = path == "/v1/chat/completions"
    prompt = {"prompt_token_ids": chat_prompt_ids(offline)} if chat else PROMPT
    full = offline.generate(prompt, greedy(16))[0].outputs[0].text
    stop = full[4:7]
    trimmed = offline.generate(prompt, greedy(16, stop=[stop]))[0].outputs[0].text
    assert not trimmed.endswith(stop)
    body = {"messages": MESSAGES} if chat else {"prompt": PROMPT}
    reply = post(server, path, {**body, "max_tokens": 16, "temperature": 0, "stop": [stop], "no_stop_trim": True})
    assert reply.status_code == 200
    choice = reply.json()["choices"][0]
    assert (choice["message"]["content"] if chat else choice["text"]) == trimmed + stop


def test_router_fields_with_their_defaults_split_the_reasoning_as_without_them(client):
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, extra_body=PINNED)
    routed = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40,
                                            extra_body={**PINNED, **ROUTER_FIELDS})
    assert (routed.choices[0].message.reasoning_content, routed.choices[0].message.content) == (
        plain.choices[0].message.reasoning_content, plain.choices[0].message.content) == ("\nRainy.\n", "It rains.")


def reasoning_and_content(server: Server, **fields) -> tuple[list[str], str, str | None, str | None]:
    """A pinned reply streamed (its reasoning deltas, its content) and whole (reasoning, content)."""
    body = {"messages": MESSAGES, "max_tokens": 40, **PINNED, **fields}
    deltas = [choice["delta"] for chunk in sse_chunks(server, "/v1/chat/completions", body) for choice in chunk["choices"]]
    message = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    return ([d["reasoning_content"] for d in deltas if d.get("reasoning_content")],
            "".join(d.get("content") or "" for d in deltas), message.get("reasoning_content"), message["content"])


def test_include_reasoning_false_drops_the_reasoning(server):
    assert reasoning_and_content(server, include_reasoning=False) == ([], "It rains.", None, "It rains.")


def test_separate_reasoning_false_leaves_the_reasoning_in_the_content(server):
    assert reasoning_and_content(server, separate_reasoning=False) == ([], THINKING, None, THINKING)


def test_stream_reasoning_false_sends_the_reasoning_in_one_delta_once_it_ends(server):
    streamed, content, reasoning, answer = reasoning_and_content(server)
    assert len(streamed) > 1  # token by token, unless held back
    assert reasoning_and_content(server, stream_reasoning=False) == (["\nRainy.\n"], content, reasoning, answer)


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": PROMPT}),
                                        ("/v1/chat/completions", {"messages": MESSAGES})], ids=["completions", "chat"])
def test_return_hidden_states_true_is_a_400_naming_it(server, path, body):
    assert post(server, path, {**body, "max_tokens": 2, "return_hidden_states": False}).status_code == 200
    refused = post(server, path, {**body, "max_tokens": 2, "return_hidden_states": True})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "return_hidden_states"
    assert "hidden states are not served" in refused.json()["error"]["message"]


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": PROMPT}),
                                        ("/v1/chat/completions", {"messages": MESSAGES})], ids=["completions", "chat"])
def test_a_made_up_field_is_still_a_400_naming_it(server, path, body):
    refused = post(server, path, {**body, "max_tokens": 2, "frobnicate_tokens": True})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "frobnicate_tokens"


@pytest.mark.parametrize("name, value", [("spaces_between_special_tokens", False), ("priority", 3),
                                         ("cache_salt", "tenant-a"), ("use_beam_search", True)])
def test_a_vllm_field_for_what_the_server_lacks_is_a_400_unless_it_asks_for_nothing(server, name, value):
    refused = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, name: value})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == name
    assert "not supported" in refused.json()["error"]["message"]
    default = {"spaces_between_special_tokens": True, "priority": 0, "cache_salt": None, "use_beam_search": False}
    assert post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, name: default[name]}).status_code == 200


def test_continuous_usage_on_completions_counts_the_tokens_streamed_so_far(server, offline):
    expected = offline.generate(PROMPT, greedy(12, ignore_eos=True))[0]
    chunks = sse_chunks(server, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 0,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *token_chunks, last = chunks
    streamed = 0
    for chunk in token_chunks:
        streamed += sum(len(choice["logprobs"]["tokens"]) for choice in chunk["choices"])
        assert chunk["usage"] == {"prompt_tokens": len(expected.prompt_token_ids), "completion_tokens": streamed,
                                  "total_tokens": len(expected.prompt_token_ids) + streamed}
    assert streamed == 12 and last["choices"] == [] and last["usage"] == token_chunks[-1]["usage"]


def test_continuous_usage_on_chat_counts_the_tokens_streamed_so_far(client, offline):
    prompt_tokens = len(chat_prompt_ids(offline))
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    streamed = 0
    for chunk in chunks[:-1]:  # the role chunk first, at 0
        streamed += sum(len(choice.logprobs.content) for choice in chunk.choices if choice.logprobs)
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.total_tokens) == (
            prompt_tokens, streamed, prompt_tokens + streamed)
    assert streamed == 10 and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_guidellm_request_bodies_get_usage_in_every_chunk(server):
    """The bodies guidellm 0.8.1 sends for a fixed output length (its OpenAI backend's request
    handlers, streaming): ``stream_options`` with ``continuous_usage_stats``, ``ignore_eos``,
    ``stop: null``; chat's user content as a list of text parts and ``max_completion_tokens``."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    bodies = [
        ("/v1/completions", {"stream": True, "stream_options": options, "max_tokens": 6, "stop": None,
                             "ignore_eos": True, "prompt": PROMPT}),
        ("/v1/chat/completions", {"stream": True, "stream_options": options, "max_completion_tokens": 6, "stop": None,
                                  "ignore_eos": True,
                                  "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]}),
    ]
    for path, body in bodies:
        chunks = sse_chunks(server, path, body)
        assert all("usage" in chunk for chunk in chunks)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_guided_choice_constrains_the_text_as_structured_outputs(server):
    reply = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "guided_choice": ["yes", "no"]})
    assert reply.json()["choices"][0]["text"] in ("yes", "no")


def test_add_special_tokens_false_tokenizes_the_prompt_without_them(server, offline):
    ids = offline.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    reply = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                             "add_special_tokens": False}).json()
    assert reply["usage"]["prompt_tokens"] == len(ids)
    assert reply["choices"][0]["text"] == offline.generate({"prompt_token_ids": ids}, greedy(4))[0].outputs[0].text


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server, offline):
    ids = offline.tokenizer(PROMPT)["input_ids"]
    assert len(ids) > 2
    reply = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                             "truncate_prompt_tokens": 2}).json()
    assert reply["usage"]["prompt_tokens"] == 2
    assert reply["choices"][0]["text"] == offline.generate({"prompt_token_ids": ids[-2:]}, greedy(4))[0].outputs[0].text


def test_request_id_names_the_reply(server):
    for path, body, prefix in (("/v1/completions", {"prompt": PROMPT}, "cmpl-"),
                               ("/v1/chat/completions", {"messages": MESSAGES}, "chatcmpl-")):
        assert post(server, path, {**body, "max_tokens": 2, "request_id": "eval-7"}).json()["id"] == prefix + "eval-7"
        assert [chunk["id"] for chunk in sse_chunks(server, path, {**body, "max_tokens": 2, "request_id": "eval-7"})
                ][0] == prefix + "eval-7"


@pytest.fixture(scope="module")
def router(server):
    """vllm-router in front of the server, both on 127.0.0.1."""
    pytest.importorskip("vllm_router")
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "vllm_router.launch_router", "--host", HOST, "--port", str(port),
         "--worker-urls", server.url, "--prometheus-host", HOST, "--prometheus-port", str(free_port()),
         "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "NO_PROXY": HOST})
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + 60
    for _ in range(240):
        if process.poll() is not None:
            raise RuntimeError(f"vllm-router exited with {process.returncode}:\n{process.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("vllm-router did not become healthy within 60 s")
        time.sleep(0.25)
    yield url
    process.terminate()
    process.wait(30)


def test_requests_through_vllm_router_answer_as_the_server_does(router, client):
    routed = openai.OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0, timeout=60)
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    assert routed.chat.completions.create(**kwargs).choices[0].message.content == \
        client.chat.completions.create(**kwargs).choices[0].message.content
    pinned = routed.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, extra_body=PINNED)
    assert (pinned.choices[0].message.reasoning_content, pinned.choices[0].message.content) == ("\nRainy.\n",
                                                                                               "It rains.")
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in routed.chat.completions.create(
        stream=True, **kwargs) if chunk.choices)
    assert streamed == client.chat.completions.create(**kwargs).choices[0].message.content
    completion = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert routed.completions.create(**completion).choices[0].text == client.completions.create(**completion).choices[0].text
