"""Shared pieces of the GPU benchmarks: model shapes, random checkpoints, result files."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import time
from pathlib import Path

import torch

# The physical limits' rates by GPU (benchmarks/README.md): HBM bytes/s and dense bf16 FLOP/s as
# reached in practice, about 90% and 80% of the datasheet's, as measured on an H200 (4.3 of 4.8
# TB/s, 790 of 989 TFLOP/s). Matched against the device's name, first match; another card takes
# the H200's unless HOOKLLM_BENCH_HBM_BYTES_PER_S / HOOKLLM_BENCH_BF16_FLOP_PER_S give its own.
GPU_RATES = {"H200": (4.3e12, 790e12), "H100 PCIe": (1.8e12, 605e12), "H100": (3.0e12, 790e12),
             "A100": (1.8e12, 250e12)}


def gpu_rates(name: str) -> tuple[float, float]:
    """(HBM bytes/s, dense bf16 FLOP/s) for the GPU called ``name``."""
    hbm, bf16 = next((rates for card, rates in GPU_RATES.items() if card in name), GPU_RATES["H200"])
    return (float(os.environ.get("HOOKLLM_BENCH_HBM_BYTES_PER_S", hbm)),
            float(os.environ.get("HOOKLLM_BENCH_BF16_FLOP_PER_S", bf16)))


HBM_BYTES_PER_S, BF16_FLOP_PER_S = gpu_rates(torch.cuda.get_device_name() if torch.cuda.is_available() else "")
FP8_FLOP_PER_S = 2 * BF16_FLOP_PER_S  # dense e4m3 rate: 2x bf16, as on the Hopper datasheets (1979 vs 989 TFLOP/s)

SHAPES = {
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                         tie_word_embeddings=True, max_position_embeddings=4096, rope_theta=500000.0),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
                       tie_word_embeddings=True, max_position_embeddings=4096, rope_theta=1000000.0),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
                         tie_word_embeddings=False, max_position_embeddings=4096, rope_theta=500000.0),
    # Sliding-window shapes (served through the transformers backend): Gemma 2 alternates 4,096-token
    # windows with full layers and soft-caps attention and final logits; Gemma 3's 1B has 5 layers
    # with 512-token windows per full layer, so workload A's contexts outgrow its windows.
    "gemma-2-2b": dict(model_type="gemma2", hidden_size=2304, num_hidden_layers=26, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=256, intermediate_size=9216, vocab_size=256000,
                       sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0, tie_word_embeddings=True, max_position_embeddings=8192),
    "gemma-3-1b": dict(model_type="gemma3_text", hidden_size=1152, num_hidden_layers=26, num_attention_heads=4,
                       num_key_value_heads=1, head_dim=256, intermediate_size=6912, vocab_size=262144,
                       sliding_window=512, query_pre_attn_scalar=256, tie_word_embeddings=True,
                       max_position_embeddings=32768),
    # Mixtures of experts (native adapters). Their bf16 weights (41-93 GB) are never written to
    # disk: the folder holds config.json only, hookllm loads random weights (load_format "dummy")
    # and the transformers peers build the model from its config on the GPU.
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936,
                          tie_word_embeddings=False, max_position_embeddings=4096, rope_theta=1000000.0),
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, num_hidden_layers=24, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=64, intermediate_size=2880, num_local_experts=32,
                        num_experts_per_tok=4, vocab_size=201088, sliding_window=128,
                        layer_types=["sliding_attention", "full_attention"] * 12, tie_word_embeddings=False),
    # An encoder (bidirectional attention, no causal LM): benchmarks/pooling.py embeds with it.
    "bert-base": dict(model_type="bert", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      num_key_value_heads=12, intermediate_size=3072, vocab_size=30522, max_position_embeddings=512,
                      type_vocab_size=2),
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                         vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=4096,
                         rope_theta=1000000.0),
}
# Shapes whose checkpoint folder holds config.json only (see above).
CONFIG_ONLY_SHAPES = ("qwen3-30b-a3b", "gpt-oss-20b", "mixtral-8x7b")
# Encoders: saved as their base model (transformers' AutoModel), their MLP two matrices, not three.
ENCODER_SHAPES = ("bert-base",)


def head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def moe_experts(config: dict) -> tuple[int, int, int] | None:
    """(experts, experts per token, expert intermediate size) of an MoE config, None for a dense one."""
    experts = config.get("num_experts") or config.get("num_local_experts")
    if not experts:
        return None
    return experts, config["num_experts_per_tok"], config.get("moe_intermediate_size") or config["intermediate_size"]


def expert_params(config: dict) -> int:
    """Weights of one expert (gate, up and down projections)."""
    _, _, inter = moe_experts(config)
    return 3 * config["hidden_size"] * inter


def linear_params_per_layer(config: dict) -> int:
    """Weights of one decoder layer's matmuls that one token multiplies: the q, k, v and o
    projections and the gated MLP, or for an MoE layer the router and its ``top_k`` experts."""
    h = config["hidden_size"]
    q, kv = config["num_attention_heads"] * head_dim(config), config["num_key_value_heads"] * head_dim(config)
    moe = moe_experts(config)
    matrices = 2 if config["model_type"] == "bert" else 3
    mlp = matrices * h * config["intermediate_size"] if moe is None else moe[1] * expert_params(config) + h * moe[0]
    return h * (q + 2 * kv) + q * h + mlp


def config_weight_bytes(config: dict) -> int:
    """bf16 bytes of every parameter of ``config``'s model (built on the meta device: nothing allocated)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(config)
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return 2 * sum(p.numel() for p in model.parameters())


def synchronize() -> None:
    """Wait for the GPU's queued work (nothing to wait for on the CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def commit() -> str:
    """The commit being measured; $HOOKLLM_COMMIT where the tree travels without .git."""
    if os.environ.get("HOOKLLM_COMMIT"):
        return os.environ["HOOKLLM_COMMIT"]
    try:
        sha = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.call(["git", "diff", "--quiet", "HEAD"], stderr=subprocess.DEVNULL) != 0
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def instrument(root: object, parts: dict[str, tuple[object, str]], totals: dict[str, float]) -> None:
    """Wrap each part's method with a host timer adding into ``totals[part]``. A part is (owner,
    method name): the owner is an object or class, or a dotted attribute path from ``root``
    ("" for ``root`` itself)."""
    for name, (owner, method) in parts.items():
        target = owner
        if isinstance(owner, str):
            target = root
            for attr in filter(None, owner.split(".")):
                target = getattr(target, attr)
        original = getattr(target, method)

        def timed(*args, _original=original, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[_name] += time.perf_counter() - start

        setattr(target, method, timed)


def kernel_times(prof: torch.profiler.profile) -> list[tuple[str, float]]:
    """Each CUDA kernel's total GPU time in seconds under ``prof``, longest first: their sum is
    the GPU's busy time."""
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    return sorted(((e.key, e.self_device_time_total / 1e6) for e in kernels), key=lambda kernel: -kernel[1])


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def random_checkpoint(shape: str, root: Path) -> Path:
    """Save a random-weight bf16 checkpoint of ``shape`` once; every engine loads this folder
    (of a ``CONFIG_ONLY_SHAPES`` shape, only its config.json)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    path = root / shape
    if (path / "config.json").exists():
        return path
    fields = dict(SHAPES[shape])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    if shape in CONFIG_ONLY_SHAPES:
        config.architectures = [config.architectures[0] if config.architectures else
                                AutoModelForCausalLM._model_mapping[type(config)].__name__]
        config.save_pretrained(path)
        return path
    torch.manual_seed(0)
    model_cls = AutoModel if shape in ENCODER_SHAPES else AutoModelForCausalLM
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = model_cls.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    return path


def has_weights(path: Path) -> bool:
    """Whether a checkpoint folder holds weights (else: a config-only shape, random weights)."""
    return any(path.glob("*.safetensors"))


def add_out_argument(parser) -> None:
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), metavar="DIR",
                        help="folder for the JSON result (default: benchmarks/results)")


def write_result(name: str, payload: dict, out_dir: str) -> Path:
    """``out_dir``/<name>.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def print_engine_table(results: dict[str, dict], columns: list[tuple[str, str, str]]) -> None:
    """One row per engine: each (header, result key, format spec) column, then hookllm's speed-up over it."""
    ours = results["hookllm"]["output_tok_s"]
    print(f"{'engine':<22}" + "".join(f"{header:>13}" for header, _, _ in columns) + f"{'hookllm x':>11}")
    for name, row in results.items():
        if "error" in row:
            print(f"{name:<22} error: {row['error'][:80]}")
            continue
        cells = "".join(f"{row[key]:>13{spec}}" for _, key, spec in columns)
        print(f"{name:<22}{cells}{ours / row['output_tok_s']:>11.2f}")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
