"""LLaVA throughput on one GPU: hookllm against transformers ``generate``, same weights, same script.

Model: random bf16 weights in the LLaVA-1.5-7B shape (CLIP ViT-L/14 at 336 px, 576 image tokens,
feature layer -2; two-layer GELU projector; Llama-2-7B decoder, vocab 32064). Workload: 64
requests, each a short prompt around one 336x336 image (a different random image per request,
so no encoder-cache sharing), 128 greedy output tokens, EOS ignored. Reported: output tok/s and
images/s = requests / wall time, after one warm-up request; image preprocessing is inside the
timed region for both engines.

    python benchmarks/llava.py [--num-requests 64] [--hf-batch-size 64] [--skip-transformers]

Writes JSON to $OUT/llava.json when $OUT is set, else to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from common import commit, device_name, now, print_engine_table, add_out_argument, write_result  # noqa: E402

IMAGE_SIZE = 336
IMAGE_TOKEN_ID = 32000
# "USER: <image>\nWhat is shown in this image? ASSISTANT:" in the Llama-2 vocabulary's shape.
PROMPT_IDS = [1, 3148, 1001, 29901, IMAGE_TOKEN_ID, 29871, 13, 5618, 338, 4318, 297, 445, 1967, 29973, 319, 1799,
              9047, 13566, 29901]


def llava_checkpoint(root: Path) -> Path:
    """Save the random LLaVA-1.5-7B-shaped checkpoint (and its CLIP preprocessor config) once."""
    from transformers import (AutoModelForImageTextToText, CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig,
                              LlavaConfig)

    path = root / "llava-1.5-7b-shape"
    if (path / "config.json").exists():
        return path
    vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                              image_size=IMAGE_SIZE, patch_size=14, projection_dim=768, hidden_act="quick_gelu")
    text = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096,
                       architectures=["LlamaForCausalLM"])
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID,
                         vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                          crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def random_images(num: int) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)) for _ in range(num)]


def summarize(name: str, seconds: float, num_requests: int, output_tokens: int) -> dict:
    row = {"output_tok_s": num_requests * output_tokens / seconds, "images_s": num_requests / seconds,
           "wall_s": seconds, "num_requests": num_requests}
    print(f"{name}: {row['output_tok_s']:.0f} output tok/s, {row['images_s']:.2f} images/s, {seconds:.1f}s",
          flush=True)
    return row


def run_hookllm(path: Path, images: list[Image.Image], args) -> dict:
    from hookllm import LLM, SamplingParams

    llm = LLM(str(path), plugins=["llava"], max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True, output_kind="final_only")
    llm.generate({"prompt_token_ids": PROMPT_IDS, "multi_modal_data": {"image": random_images(1)[0].rotate(90)}},
                 SamplingParams(max_tokens=8))  # warm-up, with an image the timed run doesn't use
    # Driven step by step to time its phases: preprocessing (add_request), the steps until every
    # prompt (image rows included) is computed, and the decode steps after.
    engine = llm.engine
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i, image in enumerate(images):
        engine.add_request(f"r{i}", {"prompt_token_ids": PROMPT_IDS, "multi_modal_data": {"image": image}}, params)
    added = time.perf_counter()
    while engine.engine_core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.engine_core.scheduler.running):
        engine.step()
    torch.cuda.synchronize()
    prefilled = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    row = summarize("hookllm", time.perf_counter() - start, len(images), args.output_tokens)
    row["phases_s"] = {"preprocess": added - start, "prefill": prefilled - added,
                       "decode": row["wall_s"] - (prefilled - start)}
    print(f"hookllm phases: {row['phases_s']}", flush=True)
    row["kv_cache_tokens"] = llm.engine.engine_core.scheduler.block_manager.num_blocks * llm.engine.config.block_size
    del llm
    return row


def run_transformers(path: Path, images: list[Image.Image], args) -> dict:
    from transformers import AutoModelForImageTextToText, CLIPImageProcessorPil

    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.bfloat16, device_map="cuda",
                                                        attn_implementation="sdpa").eval()
    processor = CLIPImageProcessorPil.from_pretrained(path)
    image_tokens = (IMAGE_SIZE // 14) ** 2
    index = PROMPT_IDS.index(IMAGE_TOKEN_ID)
    # Every prompt expands to the same length, so batches need no padding.
    expanded = PROMPT_IDS[:index] + [IMAGE_TOKEN_ID] * image_tokens + PROMPT_IDS[index + 1:]

    def run(batch_images: list[Image.Image], max_new_tokens: int) -> None:
        for b in range(0, len(batch_images), args.hf_batch_size):
            chunk = batch_images[b:b + args.hf_batch_size]
            pixels = processor(chunk, return_tensors="pt")["pixel_values"].to("cuda", torch.bfloat16)
            ids = torch.tensor([expanded] * len(chunk), device="cuda")
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                           max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)

    with torch.inference_mode():
        run(random_images(1), 8)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        run(images, args.output_tokens)
        torch.cuda.synchronize()
    return summarize("transformers", time.perf_counter() - start, len(images), args.output_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="/tmp/hookllm-bench")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--skip-transformers", action="store_true")
    add_out_argument(parser)
    args = parser.parse_args()

    path = llava_checkpoint(Path(args.root))
    images = random_images(args.num_requests)
    results = {"hookllm": run_hookllm(path, images, args)}
    gc.collect()
    torch.cuda.empty_cache()
    if not args.skip_transformers:
        try:
            results["transformers"] = run_transformers(path, images, args)
        except Exception as exc:  # a peer's failure is reported, never hides hookllm's numbers
            results["transformers"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"transformers failed: {results['transformers']['error']}", flush=True)
    payload = {"device": device_name(), "date": now(), "commit": commit(), "model": "llava-1.5-7b shape, random bf16",
               "workload": f"{args.num_requests} requests, one {IMAGE_SIZE}x{IMAGE_SIZE} image + "
                           f"{len(PROMPT_IDS) - 1} text tokens each, {args.output_tokens} greedy output tokens, "
                           "ignore_eos", "results": results}
    write_result("llava", payload, args.out)
    print(f"\n{payload['model']} on {payload['device']} ({payload['commit']})")
    print_engine_table(results, [("out tok/s", "output_tok_s", ".0f"), ("images/s", "images_s", ".2f"),
                                 ("wall s", "wall_s", ".1f")])


if __name__ == "__main__":
    main()
