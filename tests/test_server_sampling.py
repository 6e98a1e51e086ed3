"""Every sampling field of ``/v1/completions`` and ``/v1/chat/completions``, sent through the real
``openai`` client to one ``hookllm serve`` subprocess, answers as the offline ``LLM`` does with the
same ``SamplingParams``; a field the server does not honour is a 400 naming it. ``n`` choices and
``best_of`` candidates, and plugin flags as server-wide request defaults."""

from __future__ import annotations

import json
import os
import textwrap

import httpx
import openai
import pytest

from hookllm import LLM, SamplingParams
from hookllm.server.protocol import MAX_N
from server_fixtures import Server, with_chat_template

NUM_KV_BLOCKS = 128
PROMPTS = ["Hello there", "The quick brown fox"]
CONVERSATION = [{"role": "user", "content": "Say something"}]
BOOSTED = 42  # the token id the plugin tests boost

# A plugin with flags: ``--boost-token ID`` gets ``--boost`` added to its logit (dests ``boost_token``, ``boost``).
BOOST_PLUGIN = """
from hookllm import hookimpl

@hookimpl
def add_cli_options(parser):
    parser.add_argument("--boost", type=float, default=0.0, help="added to the logit of --boost-token")
    parser.add_argument("--boost-token", type=int, default=None, help="the token id to boost")

@hookimpl
def process_logits(logits, batch):
    for row, request in enumerate(batch.sampling_requests):
        extra = request.sampling_params.extra_args
        if extra.get("boost_token") is not None:
            logits[row, extra["boost_token"]] += extra["boost"]
"""


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, tmp_path_factory):
    return with_chat_template(tiny_llama_dir, tmp_path_factory.mktemp("sampling-llama") / "model")


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    """A folder holding the ``boost`` plugin as an installed distribution (module plus dist-info)."""
    site = tmp_path_factory.mktemp("site")
    (site / "boost_plugin.py").write_text(textwrap.dedent(BOOST_PLUGIN))
    dist_info = site / "boost_plugin-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: boost-plugin\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[hookllm.plugins]\nboost = boost_plugin\n")
    return site


@pytest.fixture(scope="module")
def server(model_dir, plugin_site):
    """One server for the module, with the boost plugin active and ``--boost 100`` as every request's default."""
    with pytest.MonkeyPatch.context() as env:  # the server process finds the plugin on its path
        env.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(plugin_site), os.environ.get("PYTHONPATH")])))
        env.delenv("HOOKLLM_PLUGINS", raising=False)
        server = Server([str(model_dir), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks",
                         str(NUM_KV_BLOCKS), "--served-model-name", "tiny", "--plugin", "boost", "--boost", "100"])
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def offline_text(offline: LLM, params: SamplingParams, prompt: str = PROMPTS[0]) -> str:
    return offline.generate(prompt, params)[0].outputs[0].text


def complete(client: openai.OpenAI, prompt: str = PROMPTS[0], **kwargs) -> str:
    return client.completions.create(model="tiny", prompt=prompt, **kwargs).choices[0].text


def test_logit_bias_minus_100_on_the_greedy_first_token_changes_it_as_offline(client, offline):
    first = offline.generate(PROMPTS[0], greedy(8))[0].outputs[0].token_ids[0]
    expected = offline.generate(PROMPTS[0], greedy(8, logit_bias={first: -100}))[0].outputs[0]
    assert expected.token_ids[0] != first
    assert complete(client, max_tokens=8, temperature=0, logit_bias={str(first): -100}) == expected.text


@pytest.mark.parametrize("name, kwargs", [
    ("presence_penalty", {"presence_penalty": 2.0}),
    ("frequency_penalty", {"frequency_penalty": 2.0}),
    ("repetition_penalty", {"extra_body": {"repetition_penalty": 2.0}}),  # vLLM's field, not OpenAI's
], ids=["presence", "frequency", "repetition"])
def test_penalty_of_2_equals_offline(client, offline, name, kwargs):
    expected = offline_text(offline, greedy(24, **{name: 2.0}))
    assert expected != offline_text(offline, greedy(24))
    assert complete(client, max_tokens=24, temperature=0, **kwargs) == expected


def test_seed_with_temperature_1_equals_offline_with_the_same_seed(client, offline):
    expected = offline_text(offline, SamplingParams(max_tokens=12, temperature=1.0, seed=11))
    assert complete(client, max_tokens=12, temperature=1.0, seed=11) == expected


def test_stop_string_ends_the_text_as_offline(client, offline):
    full = offline_text(offline, greedy(16))
    stop = full[4:7]
    expected = offline.generate(PROMPTS[0], greedy(16, stop=[stop]))[0].outputs[0]
    assert expected.finish_reason == "stop"
    choice = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                       stop=[stop]).choices[0]
    assert (choice.text, choice.finish_reason) == (expected.text, "stop")


def test_stop_token_id_ends_the_text_as_offline(client, offline):
    third = offline.generate(PROMPTS[0], greedy(16))[0].outputs[0].token_ids[2]
    expected = offline.generate(PROMPTS[0], greedy(16, stop_token_ids=[third]))[0].outputs[0]
    assert expected.finish_reason == "stop" and len(expected.token_ids) == 3
    response = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                         extra_body={"stop_token_ids": [third]})
    assert (response.choices[0].text, response.choices[0].finish_reason) == (expected.text, "stop")
    assert response.usage.completion_tokens == 3


def test_min_tokens_with_ignore_eos_runs_to_max_tokens_as_offline(client, offline):
    expected = offline.generate(PROMPTS[1], greedy(10, min_tokens=10, ignore_eos=True))[0].outputs[0]
    response = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=0,
                                         extra_body={"min_tokens": 10, "ignore_eos": True})
    assert response.choices[0].text == expected.text
    assert response.usage.completion_tokens == len(expected.token_ids) == 10


def test_completion_logprobs_and_their_top_alternatives_equal_offline(client, offline):
    expected = offline.generate(PROMPTS[1], greedy(4, logprobs=3))[0].outputs[0]
    logprobs = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0,
                                         logprobs=3).choices[0].logprobs
    decode = offline.tokenizer.decode
    for top, entry in zip(logprobs.top_logprobs, expected.logprobs):
        best3 = sorted(entry.items(), key=lambda item: item[1].logprob, reverse=True)[:3]
        assert top == pytest.approx({decode([token_id]): lp.logprob for token_id, lp in best3}, abs=1e-4)


def test_chat_top_logprobs_equal_offline(client, offline):
    expected = offline.chat(CONVERSATION, greedy(3, logprobs=2))[0].outputs[0]
    content = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=3, temperature=0,
                                             logprobs=True, top_logprobs=2).choices[0].logprobs.content
    for token, entry in zip(content, expected.logprobs):
        best2 = sorted(lp.logprob for lp in entry.values())[::-1][:2]
        assert [top.logprob for top in token.top_logprobs] == pytest.approx(best2, abs=1e-4)


def test_chat_maps_the_same_sampling_fields(client, offline):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, presence_penalty=1.5, logit_bias={7: 5.0},
                            top_k=20)
    expected = offline.chat(CONVERSATION, params)[0].outputs[0].text
    response = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=12, temperature=1.0,
                                              seed=5, presence_penalty=1.5, logit_bias={"7": 5.0},
                                              extra_body={"top_k": 20})
    assert response.choices[0].message.content == expected


def n_seeded(n: int, **kwargs) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=8, temperature=1.0, seed=3, **kwargs)


def test_n_choices_equal_offline_n_numbered_per_prompt_with_usage_of_all(client, offline):
    expected = offline.generate(PROMPTS, n_seeded(3))
    response = client.completions.create(model="tiny", prompt=PROMPTS, n=3, max_tokens=8, temperature=1.0, seed=3)
    # Prompt i's completion j is choice i * n + j, as OpenAI numbers them.
    assert [c.index for c in response.choices] == list(range(6))
    assert [c.text for c in response.choices] == [c.text for o in expected for c in o.outputs]
    assert len({c.text for c in response.choices}) > 1
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)  # once per prompt
    assert response.usage.completion_tokens == sum(len(c.token_ids) for o in expected for c in o.outputs)


def test_streamed_n_choices_join_to_offline_n_with_usage_of_all(client, offline):
    expected = offline.generate(PROMPTS, n_seeded(3))
    stream = client.completions.create(model="tiny", prompt=PROMPTS, n=3, max_tokens=8, temperature=1.0, seed=3,
                                       stream=True, stream_options={"include_usage": True})
    texts, reasons, usage = [""] * 6, [None] * 6, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [c.text for o in expected for c in o.outputs]
    assert reasons == [c.finish_reason for o in expected for c in o.outputs]
    assert usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert usage.completion_tokens == sum(len(c.token_ids) for o in expected for c in o.outputs)


def test_best_of_returns_the_n_candidates_of_highest_cumulative_logprob(client, offline):
    candidates = offline.generate(PROMPTS[0], n_seeded(4, logprobs=0))[0].outputs
    best = sorted(candidates, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    response = client.completions.create(model="tiny", prompt=PROMPTS[0], n=2, best_of=4, max_tokens=8,
                                         temperature=1.0, seed=3)
    assert [c.text for c in response.choices] == [c.text for c in best]
    assert [c.text for c in best] != [c.text for c in candidates[:2]]  # the ranking changed something
    assert response.choices[0].logprobs is None  # ranking needs logprobs; only asking returns them
    assert response.usage.completion_tokens == sum(len(c.token_ids) for c in candidates)  # every candidate ran


def test_ignored_openai_fields_and_null_fields_change_nothing(client, offline):
    expected = offline_text(offline, greedy(6))
    fields = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
              "prompt_cache_key": "p", "safety_identifier": "s", "suffix": None}
    assert complete(client, max_tokens=6, temperature=0, extra_body=fields) == expected


def test_a_plugin_flag_given_to_serve_is_every_requests_default_and_a_body_field_sets_its_other_key(client, offline):
    # Serve's --boost 100 reaches the request; boost_token comes as a top-level body field.
    expected = offline_text(offline, greedy(4, logit_bias={BOOSTED: 100}))
    assert expected == offline.tokenizer.decode([BOOSTED] * 4)
    assert complete(client, max_tokens=4, temperature=0, extra_body={"boost_token": BOOSTED}) == expected


def test_a_requests_extra_args_win_over_its_top_level_fields_and_the_servers_flags(client, offline):
    body = {"boost_token": BOOSTED, "boost": 50.0, "extra_args": {"boost": 0.0}}
    assert complete(client, max_tokens=4, temperature=0, extra_body=body) == offline_text(offline, greedy(4))


CHAT = {"model": "tiny", "messages": CONVERSATION}
COMPLETION = {"model": "tiny", "prompt": "x"}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {**COMPLETION, "suffix": "!"}, "suffix"),
    ("/v1/chat/completions", {**CHAT, "best_of": 2}, "best_of"),  # not an OpenAI chat field
    ("/v1/completions", {**COMPLETION, "store": True}, "store"),
    ("/v1/completions", {**COMPLETION, "stream": True, "stream_options": {"include_tokens_per_second": True}},
     "stream_options.include_tokens_per_second"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {**COMPLETION, "n": MAX_N + 1}, "n"),
    ("/v1/chat/completions", {**CHAT, "n": MAX_N + 1}, "n"),
    ("/v1/completions", {**COMPLETION, "n": 3, "best_of": 2}, "best_of"),
    ("/v1/completions", {**COMPLETION, "best_of": 2, "stream": True}, "best_of"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"5": 101}}, "logit_bias.5"),
    ("/v1/completions", {**COMPLETION, "presence_penalty": 2.5}, "presence_penalty"),
], ids=["unknown-field", "chat-best-of", "store-true", "unknown-stream-option", "top-logprobs-without-logprobs",
        "n-over-max", "chat-n-over-max", "best-of-under-n", "streamed-best-of", "logit-bias-out-of-range",
        "penalty-out-of-range"])
def test_a_field_the_server_does_not_honour_is_a_400_naming_it_and_the_server_keeps_serving(
    server, offline, path, body, param
):
    response = httpx.post(server.url + path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    after = httpx.post(server.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 4, "temperature": 0})
    assert after.json()["choices"][0]["text"] == offline_text(offline, greedy(4), "ok")
