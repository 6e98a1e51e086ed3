"""``hookllm serve`` in a subprocess, driven by the real ``openai`` client: answers equal the
offline ``LLM`` on the same checkpoint, and bad input, faults and disconnects leave it serving."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest

from hookllm import LLM, SamplingParams
from hookllm.server.protocol import MAX_N
from server_fixtures import Server, with_chat_template

NUM_KV_BLOCKS = 64
PROMPTS = ["Hello there", "The quick brown fox", "1 2 3 4"]


@pytest.fixture(scope="module")
def chat_model_dir(tiny_llama_dir, tmp_path_factory):
    return with_chat_template(tiny_llama_dir, tmp_path_factory.mktemp("chat-llama") / "model")


@pytest.fixture(scope="module")
def server(chat_model_dir):
    server = Server([str(chat_model_dir), "--device", "cpu", "--dtype", "float32",
                     "--num-kv-blocks", str(NUM_KV_BLOCKS), "--served-model-name", "tiny"])
    yield server
    assert server.stop() == 0  # SIGTERM: a clean exit


@pytest.fixture(scope="module")
def offline(chat_model_dir):
    return LLM(str(chat_model_dir), device="cpu", dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def test_greedy_completions_equal_offline_generate_with_usage(client, offline):
    expected = offline.generate(PROMPTS, greedy(12))
    response = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == [o.outputs[0].text for o in expected]
    assert [c.finish_reason for c in response.choices] == [o.outputs[0].finish_reason for o in expected]
    prompt_tokens = sum(len(offline.tokenizer(p)["input_ids"]) for p in PROMPTS)
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in expected)


def test_token_id_prompts_and_echo(client, offline):
    ids = offline.tokenizer("Hello there")["input_ids"]
    expected = offline.generate([ids], greedy(6))[0].outputs[0].text
    response = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=6, temperature=0, echo=True)
    assert [c.text for c in response.choices] == [offline.tokenizer.decode(ids) + expected] * 2


def test_streamed_completion_deltas_join_to_the_unstreamed_text(client, offline):
    expected = offline.generate(PROMPTS[1], greedy(16))[0].outputs[0]
    stream = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(offline.tokenizer(PROMPTS[1])["input_ids"])


def test_stop_string_cuts_streamed_and_unstreamed_text_alike(client, offline):
    full = offline.generate(PROMPTS[0], greedy(16))[0].outputs[0].text
    stop = full[5:8]  # a stop string taken from the middle of the greedy text
    expected = offline.generate(PROMPTS[0], greedy(16, stop=[stop]))[0].outputs[0]
    assert expected.finish_reason == "stop" and len(expected.text) < len(full)
    kwargs = dict(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop])
    assert client.completions.create(**kwargs).choices[0].text == expected.text
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs)) == expected.text


def test_completion_logprobs_equal_the_engine_logprobs(client, offline):
    expected = offline.generate(PROMPTS[2], greedy(4, logprobs=2))[0].outputs[0]
    logprobs = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=4, temperature=0,
                                         logprobs=2).choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx([lp[t].logprob for t, lp in zip(expected.token_ids, expected.logprobs)],
                                                    abs=1e-4)
    assert logprobs.tokens == [offline.tokenizer.decode([t]) for t in expected.token_ids]
    assert all(len(top) == 2 for top in logprobs.top_logprobs)


def test_seeded_sampling_is_reproducible_and_equals_offline(client, offline):
    expected = offline.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=1.0, seed=7))[0].outputs[0].text
    texts = [client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=1.0,
                                       seed=7).choices[0].text for _ in range(2)]
    assert texts == [expected, expected]


def test_extra_body_sampling_fields_reach_the_engine(client, offline):
    expected = offline.generate(PROMPTS[0], greedy(8, ignore_eos=True, min_tokens=8, top_k=1))[0].outputs[0].text
    response = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True, "min_tokens": 8, "top_k": 1})
    assert response.choices[0].text == expected


CONVERSATION = [{"role": "user", "content": "Say something"}]


def test_chat_equals_offline_chat_streamed_or_not(client, offline):
    expected = offline.chat(CONVERSATION, greedy(12))[0]
    response = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=12, temperature=0)
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=12, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == expected.outputs[0].finish_reason


def test_chat_top_logprobs(client, offline):
    expected = offline.chat(CONVERSATION, greedy(3, logprobs=3))[0].outputs[0]
    response = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=3, temperature=0,
                                              logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [lp[t].logprob for t, lp in zip(expected.token_ids, expected.logprobs)], abs=1e-4)
    assert [len(c.top_logprobs) for c in content] == [3, 3, 3]
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)


def test_models_tokenize_detokenize_version(server, offline):
    assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == ["tiny"]
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "Hello there"}).json()
    assert tokens["tokens"] == offline.tokenizer("Hello there")["input_ids"]
    assert tokens["count"] == len(tokens["tokens"])
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == offline.tokenizer.decode(tokens["tokens"])
    assert httpx.get(server.url + "/version").json()["version"] == "0.1.0"


IMAGE = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5"
         "ErkJggg==")


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": MAX_N + 1}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "min_tokens": 9, "max_tokens": 2}, 400, "min_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "word " * 600}, 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 2**70}, 400, "max_tokens"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": IMAGE}}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/x.png"}}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]}, 400, "messages"),
], ids=["malformed-json", "wrong-type", "out-of-range", "n", "min-tokens", "too-long", "max-tokens-past-context",
        "huge-max-tokens", "unknown-model",
        "image-without-plugin", "http-image", "file-image-not-allowed"])
def test_bad_request_is_an_openai_error_and_the_server_keeps_serving(server, offline, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["code"] in (status, "model_not_found")
    if param is not None:
        assert error["param"] == param
    expected = offline.generate("ok", greedy(4))[0].outputs[0].text
    after = httpx.post(server.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 4, "temperature": 0})
    assert after.json()["choices"][0]["text"] == expected
    assert server.metric("hookllm:num_used_kv_blocks") == 0


def test_32_concurrent_streams_all_complete_correctly(server, offline):
    prompts = [f"client {i} says" for i in range(32)]
    expected = [o.outputs[0].text for o in offline.generate(prompts, greedy(10))]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    async def one(prompt: str) -> str:
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                                 stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run() -> list[str]:
        async with client:
            return await asyncio.wait_for(asyncio.gather(*[one(p) for p in prompts]), timeout=60)

    assert asyncio.run(run()) == expected


def wait_for_idle(server: Server, timeout_s: float = 10.0) -> tuple[float, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        state = server.metric("hookllm:num_requests_running"), server.metric("hookllm:num_used_kv_blocks")
        if state == (0, 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "not-streaming"])
def test_a_dropped_client_is_aborted_and_its_blocks_freed(server, stream):
    aborted = server.metric("hookllm:request_success_total", 'finished_reason="abort"')
    body = json.dumps({"prompt": "a long story", "max_tokens": 480, "temperature": 0, "ignore_eos": True,
                       "stream": stream}).encode()
    # A raw socket: the client can hang up while a non-streamed response is still being computed.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # headers (and the first tokens) arrived
        deadline = time.monotonic() + 10
        while server.metric("hookllm:num_used_kv_blocks") == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.metric("hookllm:num_requests_running") == 1
    assert wait_for_idle(server) == (0, 0)
    assert server.metric("hookllm:request_success_total", 'finished_reason="abort"') == aborted + 1


def test_api_key_is_required_when_set(chat_model_dir):
    server = Server([str(chat_model_dir), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "16",
                     "--api-key", "sekrit"])
    try:
        body = {"prompt": "x", "max_tokens": 2}
        assert httpx.post(server.url + "/v1/completions", json=body).status_code == 401
        wrong = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "invalid_request_error"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="sekrit", max_retries=0)
        assert len(client.completions.create(model=chat_model_dir.name, prompt="x", max_tokens=2).choices) == 1
        assert httpx.get(server.url + "/health").status_code == 200  # health needs no key
    finally:
        assert server.stop() == 0


def test_hookllm_complete_streams_the_servers_greedy_answer(server, offline, capsys):
    from hookllm.entrypoints.cli import main

    expected = offline.generate(PROMPTS[1], greedy(10))[0].outputs[0].text
    assert main(["complete", "--url", server.url, "--max-tokens", "10", PROMPTS[1]]) == 0
    assert capsys.readouterr().out.strip() == expected.strip()


def test_hookllm_chat_answers_one_message_as_the_offline_chat(server, offline, capsys):
    from hookllm.entrypoints.cli import main

    expected = offline.chat([{"role": "user", "content": PROMPTS[0]}], greedy(10))[0].outputs[0].text
    assert main(["chat", "--url", server.url, "--max-tokens", "10", PROMPTS[0]]) == 0
    assert expected.strip() in capsys.readouterr().out
