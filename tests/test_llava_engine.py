"""The LLaVA adapter inside the engine: encoder cache lifetime, bad inputs, CLI and chat."""

import base64
import contextlib
import io

import pytest
from llava_fixtures import (  # noqa: F401 - checkpoint and reference are fixtures
    checkpoint,
    encoder_cache,
    reference,
    random_image,
    reference_greedy,
    reference_inputs,
)
from transformers import LlamaConfig

from hookllm import LLM, testing
from hookllm.entrypoints.cli import main as cli_main

PROMPT = "USER: <image> What is this? ASSISTANT:"
IMAGES = [random_image(40, 30, seed=1), random_image(25, 50, seed=2), random_image(60, 20, seed=3)]


@pytest.fixture(scope="module")
def shared_llm(checkpoint):
    return make_llm(checkpoint)


def make_llm(path, **kwargs):
    return LLM(str(path), plugins=["llava"], dtype="float32", device="cpu", **kwargs)


def image_request(image, prompt=PROMPT):
    return {"prompt": prompt, "multi_modal_data": {"image": [image]}}


def count_encoded_images(monkeypatch, llm):
    """Record the batch size of every vision tower call."""
    tower = llm.engine.engine_core.executor.model.vision_tower
    calls = []
    original = tower.forward

    def counting(pixel_values):
        calls.append(pixel_values.shape[0])
        return original(pixel_values)

    monkeypatch.setattr(tower, "forward", counting)
    return calls


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_each_image_is_encoded_once_under_chunking_and_preemption(monkeypatch, checkpoint, reference, async_scheduling):
    # 25-token prompts (16 image rows) + 24 outputs need 4 blocks each; 6 blocks force preemption.
    llm = make_llm(checkpoint, max_num_batched_tokens=7, num_kv_blocks=6, async_scheduling=async_scheduling)
    calls = count_encoded_images(monkeypatch, llm)
    batches = testing.record_batches(llm.engine)
    outputs = llm.generate([image_request(image) for image in IMAGES], testing.greedy(24))
    assert any(b.preempted_request_ids for b in batches), "the test should preempt a request"
    assert sum(calls) == len(IMAGES)
    for image, output in zip(IMAGES, outputs):
        expected = reference_greedy(reference, reference_inputs(checkpoint, PROMPT, [image]), 24)
        assert output.outputs[0].token_ids == expected
    assert len(encoder_cache(llm.engine)) == 0
    testing.assert_all_blocks_free(llm)


def test_images_needed_in_one_step_are_encoded_in_one_call(monkeypatch, checkpoint):
    llm = make_llm(checkpoint)
    calls = count_encoded_images(monkeypatch, llm)
    llm.generate([image_request(IMAGES[0]), image_request(IMAGES[1]), image_request(IMAGES[0])], testing.greedy(2))
    assert calls == [2]  # two distinct images, one batched call; the repeated image shares its entry


def test_encoder_cache_is_freed_on_abort(checkpoint):
    llm = make_llm(checkpoint)
    engine = llm.engine
    request_id = engine.add_request("a", image_request(IMAGES[0]), testing.greedy(8))
    engine.step()
    cache = encoder_cache(engine)
    assert len(cache) == 1
    engine.abort_request(request_id)
    assert len(cache) == 0
    testing.assert_all_blocks_free(llm)


def test_shared_image_stays_cached_until_its_last_user_finishes(checkpoint):
    llm = make_llm(checkpoint)
    engine = llm.engine
    first = engine.add_request("first", image_request(IMAGES[0]), testing.greedy(8))
    second = engine.add_request("second", image_request(IMAGES[0], "USER: <image> describe the picture"), testing.greedy(8))
    engine.step()
    cache = encoder_cache(engine)
    engine.abort_request(first)
    assert len(cache) == 1
    engine.abort_request(second)
    assert len(cache) == 0


@pytest.mark.parametrize("request_, message", [
    ({"prompt": "USER: <image> <image> a", "multi_modal_data": {"image": [IMAGES[0]]}},
     r"request \d+: the prompt has 2 <image> placeholder\(s\) but 1 image\(s\)"),
    ({"prompt": "USER: a cat", "multi_modal_data": {"image": [IMAGES[0]]}},
     r"request \d+: the prompt has 0 <image> placeholder\(s\) but 1 image\(s\)"),
    ("USER: <image> a cat", r"request \d+: the prompt has 1 <image> placeholder\(s\) but 0 image\(s\)"),
    (image_request(b"not an image"), r"request \d+: cannot read image"),
    (image_request("/no/such/file.png"), r"request \d+: cannot read image"),
    (image_request("data:image/png;base64,%%%"), r"request \d+: cannot read image"),
    (image_request(3.5), r"request \d+: cannot read image: expected a PIL image, a path, bytes or a data URL, got float"),
    ({"prompt": PROMPT, "multi_modal_data": {"video": [IMAGES[0]]}}, r"request \d+: LLaVA takes only images"),
], ids=["too-few-images", "no-placeholder", "no-image", "bad-bytes", "bad-path", "bad-data-url", "bad-type", "video"])
def test_bad_input_fails_alone_and_the_engine_keeps_serving(shared_llm, checkpoint, reference, request_, message):
    with pytest.raises(ValueError, match=message):
        shared_llm.generate([image_request(IMAGES[1]), request_], testing.greedy(4))
    expected = reference_greedy(reference, reference_inputs(checkpoint, PROMPT, IMAGES[:1]), 4)
    assert shared_llm.generate(image_request(IMAGES[0]), testing.greedy(4))[0].outputs[0].token_ids == expected
    assert len(encoder_cache(shared_llm.engine)) == 0
    testing.assert_all_blocks_free(shared_llm)


def test_images_for_a_text_only_model_are_refused(tmp_path):
    config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    path = testing.build_tiny_checkpoint(config, tmp_path)
    llm = make_llm(path)
    with pytest.raises(ValueError, match=r"request \d+: no active plugin takes multi_modal_data 'image' for "
                                         r"LlamaForCausalLM; plugin 'llava' serves only LlavaForConditionalGeneration"):
        llm.generate({"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": [IMAGES[0]]}})
    reference = testing.load_reference(path)
    assert llm.generate([[1, 2, 3]], testing.greedy(4))[0].outputs[0].token_ids == testing.reference_greedy(
        reference, [1, 2, 3], 4)


def run_cli(*args):
    """``hookllm generate`` in-process on the CPU: (exit code, stdout)."""
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = cli_main(["generate", "--plugin", "llava", "--device", "cpu", "--dtype", "float32", *args])
    return code, stdout.getvalue()


def load_tokenizer(path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path)


def test_cli_generate_with_an_image(checkpoint, reference, tmp_path):
    IMAGES[0].save(tmp_path / "x.png")
    code, stdout = run_cli("--model", str(checkpoint), "--image", str(tmp_path / "x.png"), "--no-chat",
                           "--max-tokens", "6", PROMPT)
    expected = reference_greedy(reference, reference_inputs(checkpoint, PROMPT, [IMAGES[0]]), 6)
    assert code == 0
    assert stdout.strip() == load_tokenizer(checkpoint).decode(expected, skip_special_tokens=True).strip()


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
CHAT_PROMPT = "<s>USER: <image>\nWhat is this? ASSISTANT:"  # the template's rendering, by hand


@pytest.fixture(scope="module")
def chat_checkpoint(checkpoint, tmp_path_factory):
    """The checkpoint with a chat template in its tokenizer."""
    path = tmp_path_factory.mktemp("llava-chat")
    for source in checkpoint.iterdir():
        (path / source.name).write_bytes(source.read_bytes())
    tokenizer = load_tokenizer(checkpoint)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def expected_chat_tokens(reference, path, max_tokens):
    inputs = reference_inputs(path, CHAT_PROMPT, [IMAGES[0]], add_special_tokens=False)  # <s> is in the text
    return inputs["input_ids"][0].tolist(), reference_greedy(reference, inputs, max_tokens)


def data_url(image):
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("part", [{"type": "image", "image": IMAGES[0]},
                                  {"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}}],
                         ids=["pil", "data-url"])
def test_chat_image_content_parts_become_placeholders(chat_checkpoint, reference, part):
    llm = make_llm(chat_checkpoint)
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
    output = llm.chat(messages, testing.greedy(8))[0]
    prompt_ids, expected = expected_chat_tokens(reference, chat_checkpoint, 8)
    assert output.prompt_token_ids == prompt_ids
    assert output.outputs[0].token_ids == expected


def test_cli_generate_with_an_image_and_a_chat_template(chat_checkpoint, reference, tmp_path):
    IMAGES[0].save(tmp_path / "x.png")
    code, stdout = run_cli("--model", str(chat_checkpoint), "--image", str(tmp_path / "x.png"), "--max-tokens", "6",
                           "What is this?")
    _, expected = expected_chat_tokens(reference, chat_checkpoint, 6)
    assert code == 0
    assert stdout.strip() == load_tokenizer(chat_checkpoint).decode(expected, skip_special_tokens=True).strip()
