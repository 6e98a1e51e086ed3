"""Embeddings per second: hookllm's pooling runner against sentence-transformers, one GPU, the
same random bf16 weights.

A decoder embedding model in a model's shape (``--shape``, default ``qwen3-0.6b``, random
weights from benchmarks/common.py) behind a sentence-transformers pipeline (last-token pooling,
Normalize), written into the checkpoint's folder. ``--num-inputs`` inputs (default 10,000) of
random token ids, lengths uniform in [16, 512]. hookllm: ``LLM.embed`` over all of them, the
median of ``--repeat`` calls. sentence-transformers: the pipeline's modules on the same weights,
fed the same token ids in padded batches sorted by length (as ``encode`` sorts them), at each
batch size of ``--st-batch-sizes``, the best one reported; tokenization is left out on both
sides. Also the FLOPs floor: 2 x parameters x tokens at the dense bf16 rate, plus attention.

    python benchmarks/pooling.py [--shape qwen3-0.6b] [--num-inputs 10000]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (BF16_FLOP_PER_S, SHAPES, add_out_argument, commit, device_name, linear_params_per_layer,  # noqa: E402
                    now, random_checkpoint, synchronize, write_result)


def embedding_pipeline(checkpoint: Path) -> Path:
    """A sentence-transformers checkpoint beside ``checkpoint`` (its files linked, not copied):
    the model, last-token pooling, Normalize."""
    path = checkpoint.with_name(checkpoint.name + "-embedding")
    path.mkdir(exist_ok=True)
    for file in checkpoint.iterdir():
        if not (path / file.name).exists():
            (path / file.name).symlink_to(file.resolve())
    hidden = json.loads((checkpoint / "config.json").read_text())["hidden_size"]
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": hidden,
                                                                "pooling_mode_lasttoken": True}))
    (path / "2_Normalize").mkdir(exist_ok=True)
    return path


def workload(num: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(16, 512))] for _ in range(num)]


def time_hookllm(path: Path, inputs: list[list[int]], repeat: int) -> tuple[float, torch.Tensor]:
    from hookllm import LLM

    llm = LLM(str(path), max_model_len=1024, max_num_seqs=256, max_num_batched_tokens=16384)
    prompts = [{"prompt_token_ids": ids} for ids in inputs]
    llm.embed(prompts[:256], use_tqdm=False)  # a first call, untimed
    walls, outputs = [], None
    for _ in range(repeat):
        synchronize()
        start = time.perf_counter()
        outputs = llm.embed(prompts, use_tqdm=False)
        synchronize()
        walls.append(time.perf_counter() - start)
    llm.shutdown()
    return statistics.median(walls), torch.tensor([o.outputs.embedding for o in outputs[:64]])


@torch.inference_mode()
def time_sentence_transformers(path: Path, inputs: list[list[int]], batch_size: int) -> tuple[float, torch.Tensor]:
    """The pipeline's forward (transformer, last-token pooling, normalize) over padded batches
    sorted by length, as ``SentenceTransformer.encode`` batches them."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
    embeddings: dict[int, torch.Tensor] = {}
    synchronize()
    start = time.perf_counter()
    for first in range(0, len(order), batch_size):
        batch = order[first:first + batch_size]
        longest = len(inputs[batch[0]])
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros(len(batch), longest, dtype=torch.long)
        for row, index in enumerate(batch):
            ids[row, :len(inputs[index])] = torch.tensor(inputs[index])
            mask[row, :len(inputs[index])] = 1
        hidden = model(input_ids=ids.cuda(), attention_mask=mask.cuda()).last_hidden_state
        last = hidden[torch.arange(len(batch)), mask.sum(dim=1).cuda() - 1]
        for row, vector in zip(batch, torch.nn.functional.normalize(last.float(), dim=-1)):
            embeddings[row] = vector
    synchronize()
    seconds = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return seconds, torch.stack([embeddings[i].cpu() for i in range(64)])


def flops_floor_s(shape: dict, inputs: list[list[int]]) -> float:
    tokens = sum(map(len, inputs))
    attention = sum(2 * 2 * len(ids) ** 2 / 2 * shape["num_attention_heads"] * shape.get("head_dim", 128)
                    for ids in inputs) * shape["num_hidden_layers"]
    return (2 * linear_params_per_layer(shape) * shape["num_hidden_layers"] * tokens + attention) / BF16_FLOP_PER_S


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-0.6b", choices=["qwen3-0.6b", "llama-3.2-1b"])
    parser.add_argument("--root", default="/tmp/hookllm-bench")
    parser.add_argument("--num-inputs", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--st-batch-sizes", default="32,128")
    add_out_argument(parser)
    args = parser.parse_args()
    path = embedding_pipeline(random_checkpoint(args.shape, Path(args.root)))
    shape = SHAPES[args.shape]
    inputs = workload(args.num_inputs, shape["vocab_size"])
    ours_s, ours = time_hookllm(path, inputs, args.repeat)
    theirs = {int(size): time_sentence_transformers(path, inputs, int(size)) for size in args.st_batch_sizes.split(",")}
    best_size = min(theirs, key=lambda size: theirs[size][0])
    theirs_s, reference = theirs[best_size]
    floor_s = flops_floor_s(shape, inputs)
    cosine = float(torch.nn.functional.cosine_similarity(ours, reference).min())
    payload = {"device": device_name(), "date": now(), "commit": commit(), "shape": args.shape,
               "num_inputs": args.num_inputs, "tokens": sum(map(len, inputs)),
               "hookllm_embeddings_per_s": args.num_inputs / ours_s,
               "sentence_transformers_embeddings_per_s": {size: args.num_inputs / s for size, (s, _) in theirs.items()},
               "speedup": theirs_s / ours_s, "flops_floor_embeddings_per_s": args.num_inputs / floor_s,
               "min_cosine_to_sentence_transformers": cosine}
    out = write_result(f"pooling-{args.shape}", payload, args.out)
    print(f"{args.shape} on {payload['device']} ({payload['commit']}), {args.num_inputs} inputs of 16-512 tokens")
    print(f"hookllm {args.num_inputs / ours_s:,.0f} embeddings/s; sentence-transformers "
          f"{args.num_inputs / theirs_s:,.0f} (batch {best_size}): {theirs_s / ours_s:.2f}x; FLOPs floor "
          f"{args.num_inputs / floor_s:,.0f}/s ({floor_s / ours_s:.0%}); min cosine {cosine:.4f}\nwrote {out}")


if __name__ == "__main__":
    main()
