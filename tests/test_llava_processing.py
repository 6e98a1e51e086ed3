"""LLaVA image preprocessing and placeholder expansion, compared with transformers."""

import pytest
import torch
from llava_fixtures import (
    IMAGE_SIZE,
    IMAGE_TOKEN_ID,
    image_processor,
    random_image,
    reference_inputs,
    save_checkpoint,
    save_tokenizer,
)
from PIL import Image
from transformers import LlavaImageProcessorPil, PreTrainedTokenizerFast

from hookllm.adapters.llava.processing import ImageProcessor, expand_request
from hookllm.engine.core_request import EngineCoreRequest
from hookllm.plugins.contract import Placeholder
from hookllm.sampling_params import SamplingParams

SIZES = [(40, 30), (25, 50), (300, 200), (13, 90)]  # non-square, up- and down-scaled
TOKENS_PER_IMAGE = (IMAGE_SIZE // 7) ** 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return PreTrainedTokenizerFast.from_pretrained(checkpoint)


def expand2square(pil_img, background_color):
    """LLaVA's original pad-to-square (llava/mm_utils.py), the reference for pad_to_square."""
    width, height = pil_img.size
    if width == height:
        return pil_img
    elif width > height:
        result = Image.new(pil_img.mode, (width, width), background_color)
        result.paste(pil_img, (0, (width - height) // 2))
        return result
    else:
        result = Image.new(pil_img.mode, (height, height), background_color)
        result.paste(pil_img, ((height - width) // 2, 0))
        return result


def reference_pixels(processor, image):
    return processor(image, return_tensors="pt")["pixel_values"][0]


@pytest.mark.parametrize("width,height", SIZES)
def test_preprocessing_equals_clip_image_processor(checkpoint, width, height):
    image = random_image(width, height, seed=width)
    ours = ImageProcessor.from_pretrained(checkpoint, IMAGE_SIZE)(image)
    assert torch.equal(ours, reference_pixels(image_processor(checkpoint), image))  # bit for bit


def test_preprocessing_without_config_uses_clip_defaults_at_tower_size(tmp_path):
    image = random_image(40, 30, seed=0)
    ours = ImageProcessor.from_pretrained(tmp_path, IMAGE_SIZE)(image)
    assert (ours - reference_pixels(image_processor(), image)).abs().max() < 1e-5


def test_preprocessing_converts_to_rgb(checkpoint):
    image = random_image(40, 30, seed=3).convert("L")
    ours = ImageProcessor.from_pretrained(checkpoint, IMAGE_SIZE)(image)
    assert (ours - reference_pixels(image_processor(checkpoint), image.convert("RGB"))).abs().max() < 1e-5


@pytest.mark.parametrize("width,height", SIZES)
def test_pad_to_square_equals_expand2square_then_clip(width, height):
    image = random_image(width, height, seed=height)
    reference = image_processor()
    ours = ImageProcessor(IMAGE_SIZE, crop_size=(IMAGE_SIZE, IMAGE_SIZE), pad_to_square=True)(image)
    padded = expand2square(image, tuple(int(x * 255) for x in reference.image_mean))
    assert (ours - reference_pixels(reference, padded)).abs().max() < 1e-5


def test_do_pad_in_preprocessor_config_equals_llava_image_processor(tmp_path):
    reference = LlavaImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                       crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_pad=True)
    reference.save_pretrained(tmp_path)
    image = random_image(25, 50, seed=5)
    ours = ImageProcessor.from_pretrained(tmp_path, IMAGE_SIZE)(image)
    assert (ours - reference_pixels(reference, image)).abs().max() < 1e-5


def make_request(tokenizer, prompt=None, token_ids=None, images=()):
    token_ids = token_ids if token_ids is not None else tokenizer(prompt)["input_ids"]
    return EngineCoreRequest("r1", token_ids, SamplingParams(), prompt=prompt, multi_modal_data={"image": list(images)})


def expand(request, tokenizer, checkpoint):
    processor = ImageProcessor.from_pretrained(checkpoint, IMAGE_SIZE)
    expand_request(request, tokenizer, Placeholder(IMAGE_TOKEN_ID, TOKENS_PER_IMAGE), processor)
    return request


def test_string_prompt_expands_like_llava_processor(checkpoint, tokenizer):
    prompt = "USER: <image> compare <image> two images ASSISTANT:"
    images = [random_image(40, 30, seed=1), random_image(25, 50, seed=2)]
    request = expand(make_request(tokenizer, prompt, images=images), tokenizer, checkpoint)
    reference = reference_inputs(checkpoint, prompt, images)
    assert request.prompt_token_ids == reference["input_ids"][0].tolist()
    assert [(m.offset, m.length) for m in request.mm_items] == [(3, 16), (20, 16)]
    for item, pixels in zip(request.mm_items, reference["pixel_values"]):
        assert item.modality == "image" and (item.data - pixels).abs().max() < 1e-5


def test_token_id_prompt_expands_each_image_token(checkpoint, tokenizer):
    request = make_request(tokenizer, token_ids=[1, IMAGE_TOKEN_ID, 5, 6], images=[random_image(40, 30, seed=1)])
    expand(request, tokenizer, checkpoint)
    assert request.prompt_token_ids == [1] + [IMAGE_TOKEN_ID] * TOKENS_PER_IMAGE + [5, 6]
    assert (request.mm_items[0].offset, request.mm_items[0].length) == (1, TOKENS_PER_IMAGE)


def test_prompt_is_split_on_placeholder_when_tokenizer_lacks_it(checkpoint, tmp_path):
    tokenizer = save_tokenizer(tmp_path, knows_image=False)
    prompt = "USER: <image> What is this? ASSISTANT:"
    assert IMAGE_TOKEN_ID not in tokenizer(prompt)["input_ids"]
    request = expand(make_request(tokenizer, prompt, images=[random_image(40, 30, seed=1)]), tokenizer, checkpoint)
    before = tokenizer("USER:")["input_ids"]  # BOS, USER, :
    after = tokenizer(" What is this? ASSISTANT:", add_special_tokens=False)["input_ids"]
    assert request.prompt_token_ids == before + [IMAGE_TOKEN_ID] * TOKENS_PER_IMAGE + after


def test_split_prompt_starting_with_bos_text_gets_no_second_bos(checkpoint, tmp_path):
    tokenizer = save_tokenizer(tmp_path, knows_image=False)
    prompt = "<s>USER: <image> a"  # chat-template output: the core tokenized it without special tokens
    request = make_request(tokenizer, prompt, token_ids=tokenizer(prompt, add_special_tokens=False)["input_ids"],
                           images=[random_image(40, 30, seed=1)])
    expand(request, tokenizer, checkpoint)
    bos, user, colon, a = 1, *tokenizer.convert_tokens_to_ids(["USER", ":", "a"])
    assert request.prompt_token_ids == [bos, user, colon] + [IMAGE_TOKEN_ID] * TOKENS_PER_IMAGE + [a]


def test_content_hash_is_the_same_for_a_pil_image_its_file_and_its_bytes(checkpoint, tokenizer, tmp_path):
    image = random_image(40, 30, seed=7)
    image.save(tmp_path / "x.png")
    sources = [image, str(tmp_path / "x.png"), (tmp_path / "x.png").read_bytes()]
    hashes = {expand(make_request(tokenizer, "<image> a", images=[s]), tokenizer, checkpoint).mm_items[0].content_hash
              for s in sources}
    other = expand(make_request(tokenizer, "<image> a", images=[random_image(40, 30, seed=8)]), tokenizer, checkpoint)
    assert len(hashes) == 1 and other.mm_items[0].content_hash not in hashes
