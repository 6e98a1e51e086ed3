"""LoRA adapters over HTTP, through the real ``openai`` client: a request's ``model`` names an
adapter of ``--lora-modules``, of a runtime load (``POST /v1/load_lora_adapter``, with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) or of the ``resolve_lora_adapter`` hook, and its answer
equals the offline ``LLM``'s with that adapter; ``/v1/models`` lists the adapters; names nothing
serves are 404s and adapters that do not fit are 400s naming them; ``/metrics`` has vLLM's
``lora_requests_info``.

Two servers: one with LoRA (and a resolver plugin), one without, whose LoRA routes and names are absent.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import time
import types

import httpx
import openai
import pytest
from transformers import AutoConfig

from hookllm import LLM, SamplingParams
from hookllm.lora.request import LoRARequest
from hookllm.server.lora_registry import LoRAModulePath, LoRARegistry, parse_lora_module
from lora_fixtures import ADAPTER_SPECS, build_adapter
from server_fixtures import Server, tiny_chat_model

pytest.importorskip("peft")

MAX_POSITIONS = 4096  # room for a request that runs until the metrics test closes it
MAX_TOKENS = 8
PROMPT = "Hello there"
CONVERSATION = [{"role": "user", "content": "Say something"}]
TOO_BIG = dict(r=32, lora_alpha=32, target_modules=["q_proj"])  # over --max-lora-rank 16
# Resolves "found-<adapter>" to that adapter's folder, any other name to nothing.
RESOLVER_PLUGIN = """
from pathlib import Path

from hookllm import hookimpl

@hookimpl
def resolve_lora_adapter(lora_name):
    folder = Path({root!r}) / lora_name.removeprefix("found-")
    return str(folder) if lora_name.startswith("found-") and folder.is_dir() else None
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("lora-llama"), MAX_POSITIONS)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """PEFT folders of the model: three adapters, and one of a rank over the server's limit."""
    root = tmp_path_factory.mktemp("adapters")
    specs = {**ADAPTER_SPECS, "too-big": TOO_BIG}
    return {name: build_adapter(model_dir, root / name, seed, **spec)
            for seed, (name, spec) in enumerate(specs.items())}


@pytest.fixture(scope="module")
def plugin_site(adapters, tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    (site / "lora_resolver_plugin.py").write_text(RESOLVER_PLUGIN.format(root=str(adapters["attn"].parent)))
    dist_info = site / "lora_resolver_plugin-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: lora-resolver-plugin\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[hookllm.plugins]\nlora-resolver = lora_resolver_plugin\n")
    return site


@pytest.fixture(scope="module")
def server(model_dir, adapters, plugin_site):
    json_module = json.dumps({"name": "all", "path": str(adapters["all"]), "base_model_name": "model"})
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(plugin_site), os.environ.get("PYTHONPATH")])))
        env.delenv("HOOKLLM_PLUGINS", raising=False)
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        # One request at a time: the metrics test holds one running and one waiting.
        server = Server([str(model_dir), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "600",
                         "--served-model-name", "tiny", "--max-num-seqs", "1", "--enable-lora", "--max-loras", "2",
                         "--max-lora-rank", "16", "--plugin", "lora-resolver",
                         "--lora-modules", f"attn={adapters['attn']}", json_module])
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def plain_server(model_dir):
    """No --enable-lora, no runtime updating."""
    with pytest.MonkeyPatch.context() as env:
        env.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
        env.delenv("HOOKLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
        server = Server([str(model_dir), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64",
                         "--served-model-name", "tiny"])
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def offline(model_dir, adapters):
    """The offline engine's greedy answers, per adapter name (None: the base model): a
    completion of PROMPT and a chat reply to CONVERSATION."""
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=3)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    answers = {}
    for lora_int_id, name in enumerate([None, "attn", "all", "some"]):
        lora = None if name is None else LoRARequest(name, lora_int_id, str(adapters[name]))
        completion = llm.generate(PROMPT, params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
        chat = llm.chat(CONVERSATION, params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
        answers[name] = (completion, chat)
    llm.shutdown()
    for kind in (0, 1):  # each adapter changes both answers: the comparisons prove something
        assert len({answer[kind] for answer in answers.values()}) == len(answers)
    return answers


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def complete(server: Server, model: str) -> str:
    response = client(server).completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert response.model == model
    return response.choices[0].text


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_lora_modules_flag_takes_name_path_and_vllms_json():
    assert parse_lora_module("a=/p/a") == LoRAModulePath("a", "/p/a")
    json_form = '{"name": "b", "path": "/p/b", "base_model_name": "m"}'
    assert parse_lora_module(json_form) == LoRAModulePath("b", "/p/b", "m")
    for bad in ("a", "=/p", '{"name": "a"}', '{"name": "a", "path": "/p", "rank": 8}', "{nope"):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME=PATH|name and path|JSON"):
            parse_lora_module(bad)


def test_lora_modules_need_enable_lora(capsys, adapters):
    from hookllm.entrypoints.cli import main

    assert main(["serve", "--lora-modules", f"attn={adapters['attn']}"]) == 2
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err


def test_registry_checks_startup_adapters_and_never_reuses_an_id(model_dir, adapters):
    config = types.SimpleNamespace(enable_lora=True, max_lora_rank=16, model=str(model_dir))
    engine = types.SimpleNamespace(config=config, model_config=types.SimpleNamespace(
        hf_config=AutoConfig.from_pretrained(model_dir)))

    def registry(*modules: LoRAModulePath, api_server: tuple[int, int] = (0, 1)) -> LoRARegistry:
        return LoRARegistry(engine, ["tiny"], [str(model_dir), "tiny"], list(modules), api_server)

    with pytest.raises(ValueError, match="'too-big'.*max_lora_rank"):
        registry(LoRAModulePath("too-big", str(adapters["too-big"])))
    with pytest.raises(ValueError, match="'tiny': the name is the base model's"):
        registry(LoRAModulePath("tiny", str(adapters["attn"])))
    # Startup adapters are 1, 2 in every API server process; later ones strided by the process's index.
    loras = registry(LoRAModulePath("attn", str(adapters["attn"])), LoRAModulePath("all", str(adapters["all"])),
                     api_server=(1, 3))
    assert [a.lora_int_id for a in loras.adapters()] == [1, 2]

    async def churn() -> list[int]:
        ids = [(await loras.load("late", str(adapters["some"]))).lora_int_id]
        loras.remove("late")
        ids.append((await loras.load("late", str(adapters["some"]))).lora_int_id)
        return ids

    assert asyncio.run(churn()) == [4, 7]


def test_adapter_names_run_their_adapters_as_offline(server, offline):
    assert complete(server, "tiny") == offline[None][0]
    assert complete(server, "attn") == offline["attn"][0]
    assert complete(server, "all") == offline["all"][0]
    reply = client(server).chat.completions.create(model="attn", messages=CONVERSATION, max_tokens=MAX_TOKENS,
                                                   temperature=0)
    assert (reply.model, reply.choices[0].message.content) == ("attn", offline["attn"][1])
    stream = client(server).chat.completions.create(model="all", messages=CONVERSATION, max_tokens=MAX_TOKENS,
                                                    temperature=0, stream=True)
    chunks = list(stream)
    assert {chunk.model for chunk in chunks} == {"all"}
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == offline["all"][1]


def test_models_lists_each_adapter_with_its_folder_and_parent(server, adapters):
    cards = {card["id"]: card for card in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]}
    assert cards["tiny"]["parent"] is None
    for name in ("attn", "all"):
        assert (cards[name]["root"], cards[name]["parent"]) == (str(adapters[name]), "tiny")


def test_unknown_names_are_404s_naming_them(server):
    with pytest.raises(openai.NotFoundError) as raised:
        complete(server, "nope")
    assert raised.value.body == {"message": "The model `nope` does not exist.", "type": "invalid_request_error",
                                 "param": "model", "code": "model_not_found"}


def test_load_and_unload_at_run_time(server, adapters, offline):
    answer = post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["some"])})
    assert (answer.status_code, answer.text) == (200, "Success: LoRA adapter 'late' added successfully.")
    assert complete(server, "late") == offline["some"][0]
    again = post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["attn"])})
    assert again.status_code == 400 and "'late' has already been loaded" in again.json()["error"]["message"]
    assert "late" in [card.id for card in client(server).models.list().data]

    answer = post(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert (answer.status_code, answer.text) == (200, "Success: LoRA adapter 'late' removed successfully.")
    with pytest.raises(openai.NotFoundError, match="The model `late` does not exist"):
        complete(server, "late")
    assert "late" not in [card.id for card in client(server).models.list().data]
    gone = post(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert gone.status_code == 404
    assert gone.json()["error"]["message"] == "The lora adapter 'late' cannot be found."

    # The name again, other weights (a new id: nothing of the old adapter's is reused).
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["attn"])}).is_success
    assert complete(server, "late") == offline["attn"][0]


def test_an_adapter_that_does_not_fit_is_a_400_naming_it(server, adapters):
    answer = post(server, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(adapters["too-big"])})
    assert answer.status_code == 400
    assert "'big'" in answer.json()["error"]["message"] and "max_lora_rank" in answer.json()["error"]["message"]
    missing = post(server, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": "/no/such/folder"})
    assert missing.status_code == 400 and "'gone'" in missing.json()["error"]["message"]
    assert "big" not in [card.id for card in client(server).models.list().data]


def test_the_resolver_hook_finds_names_nothing_else_gave(server, offline, adapters):
    assert complete(server, "found-some") == offline["some"][0]
    cards = {card["id"]: card for card in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]}
    assert cards["found-some"]["root"] == str(adapters["some"])
    with pytest.raises(openai.BadRequestError, match="'found-too-big'.*max_lora_rank"):
        complete(server, "found-too-big")


def lora_info(server: Server) -> list[dict[str, str]]:
    """The label sets of /metrics' vllm:lora_requests_info samples."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=10).text
    return [sample.labels for family in text_string_to_metric_families(text)
            if family.name == "vllm:lora_requests_info" for sample in family.samples]


def test_metrics_name_the_running_and_waiting_adapters(server):
    assert lora_info(server) == [{"model_name": "tiny", "engine": "0", "max_lora": "2", "running_lora_adapters": "",
                                  "waiting_lora_adapters": ""}]
    body = {"model": "attn", "prompt": PROMPT, "max_tokens": MAX_POSITIONS - 64, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as running:
        lines = running.iter_lines()  # held: a dropped iterator would close the stream, aborting attn
        next(lines)  # attn runs, and holds the one seat (--max-num-seqs 1)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(complete, server, "all")
            deadline = time.monotonic() + 30
            while (info := lora_info(server)[0])["waiting_lora_adapters"] != "all":
                assert time.monotonic() < deadline, info
                time.sleep(0.05)
            assert info["running_lora_adapters"] == "attn"
            running.close()  # aborts attn: all runs
            assert waiting.result(timeout=60)


def test_without_lora_the_routes_and_names_are_absent(plain_server):
    assert post(plain_server, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"}).status_code == 404
    assert post(plain_server, "/v1/unload_lora_adapter", {"lora_name": "a"}).status_code == 404
    with pytest.raises(openai.NotFoundError, match="The model `attn` does not exist"):
        complete(plain_server, "attn")
    assert lora_info(plain_server) == []
