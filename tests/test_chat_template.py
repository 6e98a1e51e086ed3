"""The chat template rule (docs/vllm-compat.md): a chat needs a chat template, the tokenizer's or
one given (``LLM.chat(chat_template=...)``, a request's ``chat_template``, ``--chat-template``
FILE_OR_STRING); ``hookllm generate`` on a model without one sends the prompt raw and says so.

The tiny Llama has no chat template. What a template renders is worked out here with
transformers' own ``apply_chat_template``.
"""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from hookllm import testing
from hookllm.entrypoints.cli import main
from server_fixtures import Server

# A template with a preamble of its own, so its prompt is far from the raw message's.
SERVER_TEMPLATE = ("A chat between a curious user and a tiny model.\n"
                   "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}[assistant] {% endif %}")
REQUEST_TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def rendered_ids(model_dir, template: str, messages=MESSAGES) -> list[int]:
    """``messages`` through ``template`` by transformers, tokenized as the rendered text is (no
    special tokens added: the template holds them)."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    template_file = tmp_path_factory.mktemp("template") / "chat.jinja"
    template_file.write_text(SERVER_TEMPLATE)
    server = Server([str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "16",
                     "--served-model-name", "tiny", "--chat-template", str(template_file)])
    yield server
    assert server.stop() == 0


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_llm_chat_on_a_model_without_a_chat_template_names_the_fix(make_llm):
    with pytest.raises(ValueError, match=r"no chat template: give one \(LLM.chat\(chat_template=...\).*"
                                         r"--chat-template FILE_OR_STRING"):
        make_llm().chat(MESSAGES)


def test_serve_renders_chats_with_its_chat_template_file(client, tiny_llama_dir):
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    assert reply.usage.prompt_tokens == len(rendered_ids(tiny_llama_dir, SERVER_TEMPLATE))


def test_a_requests_chat_template_wins_over_serves(client, tiny_llama_dir):
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                           extra_body={"chat_template": REQUEST_TEMPLATE})
    assert reply.usage.prompt_tokens == len(rendered_ids(tiny_llama_dir, REQUEST_TEMPLATE))


def test_serve_with_a_missing_chat_template_file_exits_naming_it(capsys):
    assert main(["serve", "--chat-template", "no/such/chat.jinja"]) == 2
    assert "--chat-template 'no/such/chat.jinja': no such file" in capsys.readouterr().err


def test_generate_without_a_chat_template_sends_the_prompt_raw_and_says_so(tiny_llama_dir, capsys):
    prompt = "Paris is the capital of"
    expected = testing.LLM(str(tiny_llama_dir), device="cpu").generate(prompt, testing.greedy(8))[0].outputs[0].text
    assert main(["generate", "--model", str(tiny_llama_dir), "--max-tokens", "8", "--device", "cpu", prompt]) == 0
    out, err = capsys.readouterr()
    assert out == expected + "\n"
    assert "the model has no chat template, so the prompts are sent raw" in err


def test_generate_renders_the_prompt_with_a_chat_template_string(tiny_llama_dir, capsys):
    prompt = "What is the capital of France?"
    ids = rendered_ids(tiny_llama_dir, SERVER_TEMPLATE, [{"role": "user", "content": prompt}])
    offline = testing.LLM(str(tiny_llama_dir), device="cpu")
    expected = offline.generate({"prompt_token_ids": ids}, testing.greedy(8))[0].outputs[0].text
    assert main(["generate", "--model", str(tiny_llama_dir), "--max-tokens", "8", "--device", "cpu",
                 "--chat-template", SERVER_TEMPLATE, prompt]) == 0
    out, err = capsys.readouterr()
    assert out == expected + "\n" and "no chat template" not in err
