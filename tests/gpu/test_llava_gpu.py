"""The LLaVA adapter on CUDA (bf16, Triton attention) against transformers in bf16.

Run on a machine with a GPU: ``pytest -m gpu tests/gpu/test_llava_gpu.py``. Skipped without CUDA.
"""

import pytest
import torch

from hookllm import LLM, testing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from llava_fixtures import (  # noqa: E402
    encoder_cache,
    prompt_logits_chunked,
    random_image,
    reference_inputs,
    save_checkpoint,
    tiny_llava_config,
)

PROMPTS = [
    ("USER: <image> What is this? ASSISTANT:", 1),
    ("USER: <image> compare <image> two images ASSISTANT:", 2),
    ("USER: describe the <image> picture ASSISTANT:", 1),
]


@pytest.fixture(scope="module")
def small_llava(tmp_path_factory):
    # Wider than the CPU model, with a milder decoder init (0.1): at 0.2 the random decoder
    # amplifies bf16 rounding to ~9% relative logit error in transformers itself.
    config = tiny_llava_config(
        vision=dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                    initializer_range=0.05),
        text=dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1),
    )
    return save_checkpoint(tmp_path_factory.mktemp("gpu-llava"), config)


def load(path, dtype):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(path), dtype=dtype).cuda().eval()


@pytest.fixture(scope="module")
def references(small_llava):
    """transformers in bf16 and in fp32 (the bf16 one's own error is the yardstick)."""
    return load(small_llava, torch.bfloat16), load(small_llava, torch.float32)


@pytest.fixture(scope="module")
def llm(small_llava):
    return LLM(str(small_llava), plugins=["llava"], gpu_memory_utilization=0.3, max_num_batched_tokens=16)


def images_for(count, seed):
    return [random_image(40 + 7 * i, 30 + 11 * i, seed=seed + i) for i in range(count)]


def cuda_inputs(path, prompt, images, dtype):
    inputs = reference_inputs(path, prompt, images)
    inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    return {k: v.cuda() for k, v in inputs.items()}


def relative_error(ours, theirs):
    return ((ours.float() - theirs.float()).norm() / theirs.float().norm()).item()


def test_runs_in_bf16_with_triton_attention(llm):
    worker = llm.engine.engine_core.executor
    assert worker.device.type == "cuda" and worker.dtype == torch.bfloat16
    assert worker.attention_backend.__name__.endswith("triton_attention")


def test_image_features_match_transformers_bf16(llm, small_llava, references):
    pixels = cuda_inputs(small_llava, "<image> <image>", images_for(2, seed=0), torch.bfloat16)["pixel_values"]
    with torch.inference_mode():
        ours = llm.engine.engine_core.executor.model.get_image_features(pixels)
        theirs = torch.stack(references[0].get_image_features(pixels, output_hidden_states=True).pooler_output)
    assert relative_error(ours, theirs) < 2e-2


@pytest.mark.parametrize("prompt,num_images", PROMPTS)
def test_chunked_prefill_logits_are_as_close_to_fp32_as_transformers_bf16(
        llm, small_llava, references, prompt, num_images):
    images = images_for(num_images, seed=10)
    ours = prompt_logits_chunked(llm, prompt, images, chunk=16)
    bf16, fp32 = references
    with torch.inference_mode():
        theirs = bf16(**cuda_inputs(small_llava, prompt, images, torch.bfloat16)).logits[0]
        exact = fp32(**cuda_inputs(small_llava, prompt, images, torch.float32)).logits[0]
    assert relative_error(ours, exact) < max(1.5 * relative_error(theirs, exact), 1e-2)


def test_first_greedy_tokens_match_transformers_bf16(llm, small_llava, references):
    """Wherever fp32's top two logits are clearly apart, bf16 rounding can't flip the choice."""
    requests, expected, clear = [], [], []
    bf16, fp32 = references
    for seed, (prompt, num_images) in enumerate(PROMPTS * 3):
        images = images_for(num_images, seed=100 + 10 * seed)
        requests.append({"prompt": prompt, "multi_modal_data": {"image": images}})
        with torch.inference_mode():
            top2 = fp32(**cuda_inputs(small_llava, prompt, images, torch.float32)).logits[0, -1].topk(2).values
            out = bf16.generate(**cuda_inputs(small_llava, prompt, images, torch.bfloat16), max_new_tokens=1,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
        expected.append(out[0, -1].item())
        clear.append((top2[0] - top2[1]).item() > 0.5)
    outputs = llm.generate(requests, testing.greedy(4))
    assert sum(clear) >= len(clear) // 2, "too few prompts with a clear first token"
    firsts = [o.outputs[0].token_ids[0] for o in outputs]
    assert [t for t, c in zip(firsts, clear) if c] == [t for t, c in zip(expected, clear) if c]
    assert len(encoder_cache(llm.engine)) == 0
    testing.assert_all_blocks_free(llm)
