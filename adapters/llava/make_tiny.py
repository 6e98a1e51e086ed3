"""A tiny random LLaVA checkpoint, saved as transformers saves one, and a sample image to show it
(``OUT_DIR/cat.png``): ``python -m hookllm.adapters.llava.make_tiny OUT_DIR``.

CLIP tower (28x28 images, patch 7: 16 image tokens), two-layer Llama decoder with GQA, a
word-level tokenizer of 100 ids that knows ``<image>``, a LLaVA-1.5-style chat template and a
CLIP preprocessor config. It loads and answers in seconds on a CPU, for trying the plugin and
for tests; its answers are random words.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Sequence

IMAGE_SIZE, PATCH_SIZE = 28, 7  # 16 patches: an image is 16 rows ("default") or 17 ("full")
VOCAB_SIZE = 100
IMAGE_TOKEN_ID = VOCAB_SIZE - 1
WORDS = ["USER", ":", "ASSISTANT", "What", "is", "this", "?", "a", "cat", "dog", "and", "the", "describe",
         "picture", "compare", "two", "images", "red", "blue", "green"]
# "USER: <image>\nWhat is this? ASSISTANT:", LLaVA-1.5's prompt format, for one user turn.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def tiny_llava_config(vision: dict | None = None, text: dict | None = None, **overrides: Any) -> Any:
    """The tiny ``LlavaConfig``; ``vision`` / ``text`` override fields of the CLIP / Llama sub-configs."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    # initializer_range 0.2 (not 0.02) keeps the random logits far apart, so greedy picks are stable.
    vision_fields = dict(image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=3, num_attention_heads=4, initializer_range=0.2)
    text_fields = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    return LlavaConfig(vision_config=CLIPVisionConfig(**{**vision_fields, **(vision or {})}),
                       text_config=LlamaConfig(**{**text_fields, **(text or {})}),
                       image_token_index=IMAGE_TOKEN_ID, **overrides)


def save_tokenizer(path: str | Path, knows_image: bool = True, chat_template: str | None = None) -> Any:
    """A word-level tokenizer over exactly VOCAB_SIZE ids, BOS added; ``<image>`` is id 99 when known."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    fillers = [f"w{i}" for i in range(VOCAB_SIZE - 4 - len(WORDS))]
    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>", *WORDS, *fillers, "<pad>"])}
    if knows_image:
        vocab["<image>"] = vocab.pop("<pad>")
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    extra = {"extra_special_tokens": ["<image>"]} if knows_image else {}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", **extra)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return tokenizer


def image_processor(**kwargs: Any) -> Any:
    """transformers' PIL CLIP preprocessing at the tiny tower's size (shortest edge, then center crop)."""
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                 crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, **kwargs)


def save_checkpoint(path: str | Path, config: Any = None, seed: int = 0, chat_template: str | None = None) -> Path:
    """Random weights (seeded), tokenizer and CLIP preprocessor config in ``path``."""
    from transformers import AutoModelForImageTextToText

    from hookllm.testing import build_tiny_checkpoint

    path = Path(path)
    build_tiny_checkpoint(config or tiny_llava_config(), path, seed=seed, model_cls=AutoModelForImageTextToText)
    save_tokenizer(path, chat_template=chat_template)
    image_processor().save_pretrained(path)
    return path


def save_sample_image(path: str | Path) -> Path:
    """A 64x64 PNG of a cartoon cat's face, drawn here so that trying the checkpoint needs no
    download (the random model's answer has nothing to do with it)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (64, 64), "skyblue")
    draw = ImageDraw.Draw(image)
    draw.polygon([(12, 26), (16, 4), (30, 18)], fill="orange")  # ears
    draw.polygon([(52, 26), (48, 4), (34, 18)], fill="orange")
    draw.ellipse((10, 12, 54, 56), fill="orange")  # head
    draw.ellipse((20, 26, 28, 34), fill="black")  # eyes
    draw.ellipse((36, 26, 44, 34), fill="black")
    draw.polygon([(28, 40), (36, 40), (32, 45)], fill="pink")  # nose
    path = Path(path)
    image.save(path)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hookllm.adapters.llava.make_tiny",
                                     description="Save a tiny random LLaVA checkpoint (CPU-sized) to OUT_DIR, "
                                                 "with a sample image, OUT_DIR/cat.png.")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="folder to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    path = save_checkpoint(args.out_dir, seed=args.seed, chat_template=CHAT_TEMPLATE)
    image = save_sample_image(path / "cat.png")
    print(path)
    print(f'try it: hookllm generate --model {path} --plugin llava --image {image} "What is in this picture?"')
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
