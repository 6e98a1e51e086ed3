"""``/v1/completions`` with ``echo`` and ``logprobs``, as evaluation harnesses score prompts
(lm-eval-harness's local-completions): the prompt's tokens with their logprobs (the first one's
null), then the generated ones, equal to the offline ``LLM``'s ``prompt_logprobs`` and ``logprobs``
for the same request; ``max_tokens`` 0 answers with the prompt part alone, as vLLM does."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from hookllm import LLM, SamplingParams
from server_fixtures import Server

NUM_KV_BLOCKS = 64
PROMPT = "The quick brown fox jumps"
TOP = 3


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    server = Server([str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks",
                     str(NUM_KV_BLOCKS), "--served-model-name", "tiny"])
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def expected_logprobs(offline: LLM, max_tokens: int) -> dict:
    """The offline engine's answer to the same request, in the completions API's logprobs shape."""
    out = offline.generate(PROMPT, SamplingParams(max_tokens=max(max_tokens, 1), temperature=0, ignore_eos=True,
                                                  logprobs=TOP, prompt_logprobs=TOP))[0]
    token_ids = out.prompt_token_ids + (out.outputs[0].token_ids if max_tokens else [])
    entries = out.prompt_logprobs + (out.outputs[0].logprobs if max_tokens else [])
    tokens = [offline.tokenizer.decode([token_id]) for token_id in token_ids]
    top = [None if entry is None else {offline.tokenizer.decode([t]): lp.logprob for t, lp in
                                       sorted(entry.items(), key=lambda item: -item[1].logprob)[:TOP]}
           for entry in entries]
    offsets = [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    return {"text": PROMPT + (out.outputs[0].text if max_tokens else ""), "tokens": tokens,
            "token_logprobs": [None if entry is None else entry[t].logprob for t, entry in zip(token_ids, entries)],
            "top_logprobs": top, "text_offset": offsets}


def assert_close(got: dict, expected: dict) -> None:
    assert got["tokens"] == expected["tokens"] and got["text_offset"] == expected["text_offset"]
    assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    assert got["token_logprobs"][1:] == pytest.approx(expected["token_logprobs"][1:], abs=1e-4)
    for top, want in zip(got["top_logprobs"][1:], expected["top_logprobs"][1:]):
        assert top.keys() == want.keys() and list(top.values()) == pytest.approx(list(want.values()), abs=1e-4)


def test_echo_with_max_tokens_0_answers_the_prompts_logprobs_alone(client, offline):
    expected = expected_logprobs(offline, 0)
    reply = client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=TOP, max_tokens=0)
    choice = reply.choices[0]
    assert choice.text == PROMPT
    assert_close(choice.logprobs.model_dump(), expected)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(expected["tokens"]), 0)


def test_echo_with_max_tokens_gives_the_prompts_then_the_generated_logprobs(client, offline):
    expected = expected_logprobs(offline, 3)
    choice = client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=TOP, max_tokens=3,
                                       temperature=0, extra_body={"ignore_eos": True}).choices[0]
    assert choice.text == expected["text"]
    assert_close(choice.logprobs.model_dump(), expected)


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_streamed_echo_sends_the_prompt_part_in_the_first_chunk(server, offline, max_tokens):
    expected = expected_logprobs(offline, max_tokens)
    num_prompt = len(offline.tokenizer(PROMPT)["input_ids"])
    body = {"model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": TOP, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    choices = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices += json.loads(line[len("data: "):])["choices"]
    assert choices[0]["text"].startswith(PROMPT) and len(choices[0]["logprobs"]["tokens"]) >= num_prompt
    joined = {key: [value for choice in choices for value in choice["logprobs"][key]] for key in expected
              if key != "text"}
    assert "".join(choice["text"] for choice in choices) == expected["text"]
    assert_close(joined, expected)
    assert choices[-1]["finish_reason"] == "length"


def test_max_tokens_0_without_echo_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0)
    assert refused.value.body["param"] == "max_tokens"
