"""Embeddings per second: hookllm's pooling runner against sentence-transformers, one GPU, the
same random bf16 weights, the same texts.

An embedding model in a model's shape (``--shape``: ``bert-base``, an encoder with mean pooling,
or ``qwen3-0.6b``, a decoder with last-token pooling; random weights from benchmarks/common.py)
behind a sentence-transformers pipeline (Transformer, Pooling, Normalize) written beside the
checkpoint with a small WordPiece tokenizer whose words are one token each. ``--num-inputs``
texts (default 10,000) of 16 to 512 tokens, uniform. Both sides start from the texts
(tokenization included): hookllm's ``LLM.embed`` over all of them, the median of ``--repeat``
calls; sentence-transformers' ``encode`` (bf16, sdpa attention, the texts sorted by length as it
does) at each batch size of ``--st-batch-sizes``, the best one reported. Also the FLOPs floor:
2 x parameters x tokens at the dense bf16 rate, plus attention. ``--no-compile-too`` times
hookllm once more without torch.compile (CUDA graphs still on). ``--profile`` adds a call with
host timers around the engine's parts and one under torch.profiler (GPU busy time, top kernels),
to tell whether the steps wait on the host or the device. ``--tiny`` runs the same
comparison on the CPU with a one-layer tiny BERT in float32 (a smoke test, and the host's cost
per embedding where the model costs almost nothing).

    python benchmarks/pooling.py [--shape bert-base] [--num-inputs 10000] [--no-compile-too]
    python benchmarks/pooling.py --tiny --num-inputs 500
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
from common import (BF16_FLOP_PER_S, SHAPES, add_out_argument, commit, device_name, head_dim,  # noqa: E402
                    instrument, kernel_times, linear_params_per_layer, now, random_checkpoint, synchronize,
                    write_result)

POOLING = {"bert-base": "mean", "qwen3-0.6b": "lasttoken"}


def embedding_pipeline(checkpoint: Path, pooling: str) -> Path:
    """A sentence-transformers checkpoint beside ``checkpoint`` (its files linked, not copied):
    the model, ``pooling``, Normalize, and a WordPiece tokenizer."""
    from hookllm.testing import build_tiny_wordpiece_tokenizer

    path = checkpoint.with_name(f"{checkpoint.name}-embedding-{pooling}")
    path.mkdir(exist_ok=True)
    for file in checkpoint.iterdir():
        if not (path / file.name).exists():
            (path / file.name).symlink_to(file.resolve())
    build_tiny_wordpiece_tokenizer(path)
    hidden = json.loads((checkpoint / "config.json").read_text())["hidden_size"]
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": hidden,
                                                                "pooling_mode": pooling}))
    (path / "2_Normalize").mkdir(exist_ok=True)
    return path


def workload(num: int, seed: int = 0) -> list[str]:
    """Texts of 14 to 510 words, each word one token, so 16 to 512 tokens with [CLS] and [SEP]."""
    from hookllm.testing import WORDPIECE_VOCAB

    words = [word for word in WORDPIECE_VOCAB[5:] if not word.startswith("##")]
    rng = random.Random(seed)
    return [" ".join(rng.choices(words, k=rng.randint(14, 510))) for _ in range(num)]


def tiny_checkpoint(root: Path) -> Path:
    """A one-layer tiny random BERT (float32) whose vocabulary holds the WordPiece tokenizer's."""
    from transformers import AutoModel, BertConfig

    from hookllm.testing import WORDPIECE_VOCAB

    path = root / "tiny-bert"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        config = BertConfig(vocab_size=len(WORDPIECE_VOCAB), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=512)
        AutoModel.from_config(config).save_pretrained(path)
    return path


# Where an LLM.embed call's host time goes (--profile): timers around these methods, by dotted
# path from the LLM. The tokenizer's time includes its thread's, beside the steps.
HOST_PARTS = {
    "queue requests (checks, request objects, admission)": ("", "_add_requests"),
    "tokenize (either thread)": ("engine.input_processor", "tokenize_texts"),
    "schedule": ("engine.engine_core.scheduler", "schedule"),
    "forward (build inputs, launch the model, pool)": ("engine.engine_core.executor.runner", "execute"),
    "read a step's outputs (waits for the device)": ("engine.engine_core", "_update"),
}


def start_hookllm(path: Path, texts: list[str], **engine_args):
    from hookllm import LLM

    # An encoder computes each prompt whole: steps of many prompts spread each step's fixed costs
    # (a launch per kernel and layer) over more of them.
    llm = LLM(str(path), max_model_len=512, max_num_seqs=1024, max_num_batched_tokens=65536, **engine_args)
    llm.embed(texts[:256], use_tqdm=False)  # a first call, untimed
    return llm


def profile_hookllm(path: Path, texts: list[str], **engine_args) -> dict:
    """One call with host timers around the engine's parts, then one under torch.profiler: its
    GPU busy time against the first call's wall time (a share well under 1: the steps wait on the host)."""
    from torch.profiler import ProfilerActivity, profile

    llm = start_hookllm(path, texts, **engine_args)
    totals: dict[str, float] = dict.fromkeys(HOST_PARTS, 0.0)
    instrument(llm, HOST_PARTS, totals)
    synchronize()
    start = time.perf_counter()
    llm.embed(texts, use_tqdm=False)
    synchronize()
    wall = time.perf_counter() - start
    host = dict(totals)  # this call's alone (the timers stay on under the profiler)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        llm.embed(texts, use_tqdm=False)
        synchronize()
    llm.shutdown()
    kernels = kernel_times(prof)
    return {"wall_s": wall, "host_s_by_part": host, "gpu_busy_s": sum(seconds for _, seconds in kernels),
            "top_kernels_s": {name[:80]: seconds for name, seconds in kernels[:12]}}


def time_hookllm(path: Path, texts: list[str], repeat: int, **engine_args) -> tuple[list[float], torch.Tensor]:
    llm = start_hookllm(path, texts, **engine_args)
    walls, outputs = [], None
    for _ in range(repeat):
        synchronize()
        start = time.perf_counter()
        outputs = llm.embed(texts, use_tqdm=False)
        synchronize()
        walls.append(time.perf_counter() - start)
    llm.shutdown()
    return walls, torch.tensor([o.outputs.embedding for o in outputs[:64]])


def time_sentence_transformers(path: Path, texts: list[str], batch_size: int,
                               dtype: torch.dtype = torch.bfloat16) -> tuple[float, torch.Tensor]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cuda" if torch.cuda.is_available() else "cpu",
                                model_kwargs={"dtype": dtype, "attn_implementation": "sdpa"})
    model.encode(texts[:256], batch_size=batch_size)  # a first call, untimed
    synchronize()
    start = time.perf_counter()
    embeddings = model.encode(texts, batch_size=batch_size, convert_to_tensor=True)
    synchronize()
    seconds = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return seconds, embeddings[:64].float().cpu()


def flops_floor_s(shape: dict, tokens_per_input: list[int]) -> float:
    dims = shape["num_attention_heads"] * head_dim(shape)
    attention = sum(2 * 2 * n * n * dims for n in tokens_per_input) * shape["num_hidden_layers"]  # QK^T and PV
    if shape["model_type"] != "bert":
        attention /= 2  # causal: half the pairs
    matmuls = 2 * linear_params_per_layer(shape) * shape["num_hidden_layers"] * sum(tokens_per_input)
    return (matmuls + attention) / BF16_FLOP_PER_S


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="bert-base", choices=sorted(POOLING))
    parser.add_argument("--root", default="/tmp/hookllm-bench")
    parser.add_argument("--num-inputs", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--st-batch-sizes", default="32,128")
    parser.add_argument("--no-compile-too", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="also one call with host timers by engine part, and one under torch.profiler")
    parser.add_argument("--tiny", action="store_true", help="a tiny random BERT on the CPU, float32 (smoke test)")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    shape_name = "tiny-bert" if args.tiny else args.shape
    pooling = "mean" if args.tiny else POOLING[args.shape]
    root = Path(args.root)
    path = embedding_pipeline(tiny_checkpoint(root) if args.tiny else random_checkpoint(args.shape, root), pooling)
    engine_args = {"device": "cpu", "dtype": "float32"} if args.tiny else {}
    texts = workload(args.num_inputs)
    tokens = [len(text.split()) + 2 for text in texts]
    walls, ours = time_hookllm(path, texts, args.repeat, **engine_args)
    ours_s = statistics.median(walls)
    uncompiled = statistics.median(time_hookllm(path, texts, args.repeat, torch_compile=False, **engine_args)[0]) \
        if args.no_compile_too else None
    profiled = profile_hookllm(path, texts, **engine_args) if args.profile else None
    dtype = torch.float32 if args.tiny else torch.bfloat16
    theirs = {int(size): time_sentence_transformers(path, texts, int(size), dtype)
              for size in args.st_batch_sizes.split(",")}
    best_size = min(theirs, key=lambda size: theirs[size][0])
    theirs_s, reference = theirs[best_size]
    floor_s = None if args.tiny else flops_floor_s(SHAPES[args.shape], tokens)
    cosine = float(torch.nn.functional.cosine_similarity(ours, reference).min())
    payload = {"device": device_name(), "date": now(), "commit": commit(), "shape": shape_name,
               "pooling": pooling, "num_inputs": args.num_inputs, "tokens": sum(tokens),
               "hookllm_walls_s": walls, "hookllm_embeddings_per_s": args.num_inputs / ours_s,
               "hookllm_without_torch_compile_embeddings_per_s": uncompiled and args.num_inputs / uncompiled,
               "sentence_transformers_embeddings_per_s": {size: args.num_inputs / s for size, (s, _) in theirs.items()},
               "speedup": theirs_s / ours_s, "flops_floor_embeddings_per_s": floor_s and args.num_inputs / floor_s,
               "min_cosine_to_sentence_transformers": cosine, "profile": profiled}
    out = write_result(f"pooling-{shape_name}", payload, args.out)
    print(f"{shape_name} on {payload['device']} ({payload['commit']}), {args.num_inputs} texts of 16-512 tokens")
    print(f"hookllm {args.num_inputs / ours_s:,.0f} embeddings/s; sentence-transformers "
          f"{args.num_inputs / theirs_s:,.0f} (batch {best_size}): {theirs_s / ours_s:.2f}x; "
          + (f"FLOPs floor {args.num_inputs / floor_s:,.0f}/s ({floor_s / ours_s:.0%}); " if floor_s else "")
          + f"min cosine {cosine:.4f}"
          + (f"; without torch.compile {args.num_inputs / uncompiled:,.0f}/s" if uncompiled else "")
          + f"\nwrote {out}")
    if profiled:
        wall = profiled["wall_s"]
        print(f"one call: {1e6 * wall / args.num_inputs:.0f} us a text; host parts (us a text): "
              + ", ".join(f"{part} {1e6 * s / args.num_inputs:.0f}" for part, s in profiled["host_s_by_part"].items())
              + f"; GPU busy {1e6 * profiled['gpu_busy_s'] / args.num_inputs:.0f} us a text "
              f"({profiled['gpu_busy_s'] / wall:.0%} of the wall)")
        for name, seconds in profiled["top_kernels_s"].items():
            print(f"  {1e3 * seconds:9.2f} ms  {name}")


if __name__ == "__main__":
    main()
