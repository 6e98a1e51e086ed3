"""Speculative decoding: time per output token at batch 1, output tok/s at batch 64, and
workload A with ``disable_by_batch_size``, each against the same engine setup without it.

Random weights accept nothing a real proposer guesses, and their logits are so flat that even
the target's own greedy output comes out otherwise in a step of another shape (a verification
step's rows against a one-token decode, in bf16). So the benchmark fixes what the target emits:
a plugin's ``process_logits`` raises one token per (prompt, position) far above the rest, in
every run with and without speculation (one indexed add on a step's logits), and the proposer
guesses those tokens, each corrupted with a probability chosen for a stated mean acceptance
length (tokens a request emits per speculating step: 1 + the drafts kept; with k drafts each
right with probability a, it is 1 + a + ... + a^k). The engine's own counters give the length
reached, reported beside the target.

Runs, in one process on one GPU:

1. an engine without speculation: batch 1 (one prompt of ``--prompt-len`` tokens decoding
   ``--output-len``), batch 64 (64 such requests), workload A;
2. an engine with ``speculative_config`` ``{"method": "forced", "num_speculative_tokens": 6}``:
   batch 1 for every k in ``--ks`` and mean length in ``--lengths`` (the proposer gives k
   guesses); one of ``"num_speculative_tokens": 4``: batch 64 at the length 3.0; then one with
   ``"disable_by_batch_size": --disable-by-batch-size`` too: workload A at k=4 (its tail, once few
   requests run, speculates);
3. the proposers' own cost per step: the n-gram lookup for 256 requests of 1,024 tokens each;
4. (unless ``--no-model-proposers``) ``draft_model`` with a random draft of ``--draft-shape``
   and ``eagle3`` with a random EAGLE-3 head of the target's shape (saved in the published
   format; draft vocabulary 32,000): their guesses are wrong (the forced tokens are no model's),
   so each gives batch 1 and batch 64 at k=4, the proposer's time per step (its pass over the
   step's tokens and its k guessing steps, timed apart) and the output rate then; with the
   forced runs' step time at the same k, the rate a proposer of that cost gives at each measured
   acceptance length (``projected``: the tokens of a step over the forced run's step time plus
   the proposer's; at batch 1 the time per output token is its inverse).

    python benchmarks/spec_decode.py --shape llama-3.1-8b --draft-shape llama-3.2-1b

Writes JSON to benchmarks/results/spec-decode-<shape>.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (add_out_argument, commit, device_name, now, random_checkpoint, synchronize,  # noqa: E402
                    write_result)
from throughput import (add_engine_arguments, checkpoint, engine_kwargs, random_workload,  # noqa: E402
                        resolve_engine_arguments)

MAX_K = 6


FORCE = 1e4  # added to the forced token's logit: far above any random model's spread


def forced_tokens(prompts: list[tuple[int, ...]], positions: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token the target emits at each position of each prompt's request (one id per pair)."""
    seeds = np.asarray([prompt[0] * 1_000_003 + len(prompt) * 7919 for prompt in prompts], dtype=np.int64)
    return (seeds * 31 + positions * 104_729) % vocab_size


class ForcedProposer:
    """Guesses the forced tokens, each kept right with probability ``accuracy`` (else another
    token), ``k`` of them."""

    accuracy = 1.0
    k = MAX_K

    def __init__(self, config, context):
        self.rng = np.random.default_rng(0)
        self.vocab_size = context.model_config.hf_config.vocab_size

    def propose(self, batch):
        k, num = ForcedProposer.k, len(batch.requests)
        positions = batch.num_tokens[:, None] + np.arange(k)[None, :]  # the guesses' positions
        prompts = [tuple(request.prompt_token_ids) for request in batch.requests]
        guesses = forced_tokens([p for p in prompts for _ in range(k)], positions.ravel(), self.vocab_size)
        wrong = self.rng.random(len(guesses)) >= ForcedProposer.accuracy
        guesses[wrong] = (guesses[wrong] + 1 + self.rng.integers(0, self.vocab_size - 1, int(wrong.sum()))) \
            % self.vocab_size
        return guesses.reshape(num, k), np.full(num, k)


def register_spec_proposers(proposers) -> None:
    proposers.add("forced", ForcedProposer)


def process_logits(logits, batch) -> None:
    """Raise each row's forced token far above the rest: the target emits it, whatever its weights."""
    prompts = [tuple(request.prompt_token_ids) for request in batch.sampling_requests]
    targets = forced_tokens(prompts, np.asarray(batch.sampling_positions, dtype=np.int64), logits.shape[1])
    index = torch.from_numpy(np.stack([np.arange(len(prompts)), targets])).to(logits.device, non_blocking=True)
    logits[index[0], index[1]] += FORCE


def accuracy_for(length: float, k: int) -> float:
    """The per-guess accuracy a for which 1 + a + ... + a^k equals ``length`` (bisection)."""
    low, high = 0.0, 1.0
    for _ in range(60):
        a = (low + high) / 2
        low, high = (a, high) if sum(a ** i for i in range(k + 1)) < length else (low, a)
    return (low + high) / 2


def make_engine(path: Path, args, speculative_config: dict | None):
    from hookllm import EngineConfig, hookimpl
    from hookllm.engine.llm_engine import LLMEngine
    from hookllm.plugins.manager import PluginInfo, PluginManager, discover_plugins

    plugins = discover_plugins()
    module = types.ModuleType("forced_tokens")
    module.register_spec_proposers = hookimpl(register_spec_proposers)
    module.process_logits = hookimpl(process_logits)
    plugins["forced_tokens"] = PluginInfo("forced_tokens", module)
    config = EngineConfig(str(path), max_model_len=4096, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, speculative_config=speculative_config,
                          plugins=["forced_tokens"], **engine_kwargs(args))
    return LLMEngine(config, PluginManager(plugins))


def run(engine, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, list[list[int]]]:
    """Seconds to generate every prompt greedily to its length (ignore_eos), and the outputs."""
    from hookllm import SamplingParams

    engine.reset_prefix_cache()
    synchronize()
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=n,
                                                                                ignore_eos=True))
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
    synchronize()
    return time.perf_counter() - start, [outputs[str(i)] for i in range(len(prompts))]


def acceptance_length(engine, before) -> float:
    """Mean tokens emitted per speculating step since ``before`` (engine stats)."""
    stats = engine.get_stats()
    drafts = stats.spec_num_drafts - before.spec_num_drafts
    accepted = stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    return 1 + accepted / drafts if drafts else 1.0


def ngram_cost(num_requests: int = 256, length: int = 1024, k: int = 4) -> float:
    """Seconds of one n-gram lookup (lengths 5 down to 1) over ``num_requests`` histories."""
    from hookllm.spec.ngram import prompt_lookup

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32000, (num_requests, length))
    lengths = np.full(num_requests, length)
    prompt_lookup(tokens, lengths, k, 1, 5)
    start = time.perf_counter()
    for _ in range(5):
        prompt_lookup(tokens, lengths, k, 1, 5)
    return (time.perf_counter() - start) / 5


class DraftTimer:
    """Seconds a model proposer spends in its ``follow`` and its ``propose``, the device
    synchronized around each call, summed apart since the last ``take``."""

    def __init__(self, proposer):
        self.seconds = {"follow": 0.0, "propose": 0.0}
        self.calls = 0
        for name in self.seconds:
            setattr(proposer, name, self._timed(getattr(proposer, name), name))

    def _timed(self, method, name: str):
        def timed(*args, **kwargs):
            synchronize()
            start = time.perf_counter()
            result = method(*args, **kwargs)
            synchronize()
            self.seconds[name] += time.perf_counter() - start
            self.calls += name == "propose"
            return result
        return timed

    def take(self) -> dict[str, float]:
        """Mean seconds of each per proposing step since the last take."""
        means = {name: seconds / max(self.calls, 1) for name, seconds in self.seconds.items()}
        self.seconds, self.calls = dict.fromkeys(self.seconds, 0.0), 0
        return means


def random_eagle3_head(target: Path, draft_vocab: int = 32000) -> Path:
    """A random EAGLE-3 head for the checkpoint ``target``, saved once beside it in the published
    format (``midlayer.*``, ``fc``, ``lm_head`` over ``draft_vocab`` ids, ``d2t``)."""
    import json

    import torch
    from safetensors.torch import save_file

    path = target.parent / f"{target.name}-eagle3-head"
    if (path / "model.safetensors").exists():
        return path
    config = json.loads((target / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"midlayer.self_attn.q_proj.weight": (q, 2 * hidden), "midlayer.self_attn.k_proj.weight": (kv, 2 * hidden),
              "midlayer.self_attn.v_proj.weight": (kv, 2 * hidden), "midlayer.self_attn.o_proj.weight": (hidden, q),
              "midlayer.mlp.gate_proj.weight": (inter, hidden), "midlayer.mlp.up_proj.weight": (inter, hidden),
              "midlayer.mlp.down_proj.weight": (hidden, inter), "fc.weight": (hidden, 3 * hidden),
              "lm_head.weight": (draft_vocab, hidden)}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(0)
    tensors = {name: (torch.randn(shape, generator=generator, device=device) * 0.02).to(torch.bfloat16).cpu()
               for name, shape in shapes.items()}
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        tensors[f"{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    tensors["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    head_config = {key: config[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                "num_key_value_heads", "vocab_size", "max_position_embeddings",
                                                "rms_norm_eps", "rope_theta") if key in config}
    head_config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                       head_dim=head_dim, draft_vocab_size=draft_vocab, tie_word_embeddings=False)
    layers = config["num_hidden_layers"]
    if layers < 6:  # too few for the default layers (2, n / 2, n - 3): --tiny's
        head_config["eagle_aux_hidden_state_layer_ids"] = [0, layers // 2, layers - 1]
    (path / "config.json").write_text(json.dumps(head_config))
    return path


def measure_proposer(path: Path, speculative_config: dict, args, workloads: dict, base: dict,
                     rows: list[dict]) -> list[dict]:
    """Section 4: a model proposer's cost at batch 1 and ``--batch``, and the projection."""
    engine = make_engine(path, args, {**speculative_config, "num_speculative_tokens": 4})
    timer = DraftTimer(engine.engine_core.executor.runner.spec.proposer)
    run(engine, workloads["batch 1"][0], [8])
    timer.take()
    draft_rows = []
    for name in ("batch 1", f"batch {args.batch}"):
        prompts, max_tokens = workloads[name]
        before = engine.get_stats()
        seconds, _ = run(engine, prompts, max_tokens)
        tokens = sum(max_tokens)
        spent = timer.take()
        row = {"method": speculative_config["method"], "workload": name, "k": 4,
               "length": acceptance_length(engine, before), "follow_ms_per_step": spent["follow"] * 1e3,
               "propose_ms_per_step": spent["propose"] * 1e3,
               "draft_ms_per_step": sum(spent.values()) * 1e3, "output_tok_s": tokens / seconds,
               "base_output_tok_s": tokens / base[name], "x_base": base[name] / seconds}
        for forced in rows:
            if forced["workload"] == name and forced["k"] == 4:
                # A forced run's step emits length tokens per request; the proposer adds its time to each.
                emitted = len(prompts) * forced["length"]
                step_s = emitted / forced["output_tok_s"] + row["draft_ms_per_step"] / 1e3
                row.setdefault("projected_x_base", {})[f"{forced['length']:.2f}"] = (
                    emitted / step_s / row["base_output_tok_s"])
        draft_rows.append(row)
        print(row, flush=True)
    engine.shutdown()
    return draft_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(parser)
    parser.set_defaults(shape="llama-3.1-8b")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--ks", default="2,4,6", help="drafts per step at batch 1")
    parser.add_argument("--lengths", default="1.5,2.0,3.0", help="mean acceptance lengths at batch 1")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--disable-by-batch-size", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=None, help="workload A's requests (default 256)")
    parser.add_argument("--model-proposers", action=argparse.BooleanOptionalAction, default=True,
                        help="section 4 (the draft model and the EAGLE-3 head)")
    parser.add_argument("--draft-shape", default="llama-3.2-1b",
                        help="the draft model's shape (section 4; with --tiny the tiny model itself); none: skip it")
    add_out_argument(parser)
    args = parser.parse_args()
    resolve_engine_arguments(args)
    from hookllm.distributed import cleanup_dist_env_and_memory

    path = checkpoint(args)
    shape = "tiny" if args.tiny else args.shape
    rng = np.random.default_rng(0)
    vocab = 300 if args.tiny else 10000
    single = [rng.integers(0, vocab, args.prompt_len).tolist()]
    batch = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(args.batch)]
    a_prompts, a_tokens = random_workload("a", args.num_requests)
    a_prompts = [[t % vocab for t in p] for p in a_prompts]
    workloads = {"batch 1": (single, [args.output_len]), f"batch {args.batch}": (batch, [args.output_len] * args.batch),
                 "workload A": (a_prompts, a_tokens)}

    engine = make_engine(path, args, None)
    run(engine, single, [8])  # untimed: what the start-up warm-up left to compile
    base: dict[str, float] = {}
    for name, (prompts, max_tokens) in workloads.items():
        seconds, _ = run(engine, prompts, max_tokens)
        base[name] = seconds
        print(f"no speculation, {name}: {sum(max_tokens) / seconds:.0f} tok/s", flush=True)
    engine.shutdown()
    del engine
    cleanup_dist_env_and_memory()

    # Batch 1 and the larger batch speculate at every step; workload A on an engine that stops
    # speculating while more than --disable-by-batch-size requests run.
    engine = make_engine(path, args, {"method": "forced", "num_speculative_tokens": MAX_K})
    ForcedProposer.k, ForcedProposer.accuracy = 1, 1.0
    run(engine, single, [8])
    rows = []

    def measure(engine, name: str, k: int, length: float) -> None:
        prompts, max_tokens = workloads[name]
        ForcedProposer.k, ForcedProposer.accuracy = k, accuracy_for(length, k) if length < k + 1 else 1.0
        before = engine.get_stats()
        seconds, _ = run(engine, prompts, max_tokens)
        tokens = sum(max_tokens)
        row = {"workload": name, "k": k, "target_length": length, "length": acceptance_length(engine, before),
               "output_tok_s": tokens / seconds, "base_output_tok_s": tokens / base[name],
               "x_base": base[name] / seconds}
        if name == "batch 1":
            row["tpot_ms"], row["base_tpot_ms"] = seconds / tokens * 1e3, base[name] / tokens * 1e3
        rows.append(row)
        print(row, flush=True)

    for k in map(int, args.ks.split(",")):
        for length in map(float, args.lengths.split(",")):
            if length <= k + 1:
                measure(engine, "batch 1", k, length)
    engine.shutdown()
    del engine
    cleanup_dist_env_and_memory()
    # The larger batches on engines of k = 4, whose CUDA graphs have its verification steps' sizes.
    disabled = {"disable_by_batch_size": args.disable_by_batch_size}
    for name, limit in ((f"batch {args.batch}", {}), ("workload A", disabled)):
        engine = make_engine(path, args, {"method": "forced", "num_speculative_tokens": 4, **limit})
        run(engine, single, [8])
        measure(engine, name, 4, 3.0)
        engine.shutdown()
        del engine
        cleanup_dist_env_and_memory()

    draft_rows = []
    if args.model_proposers and args.draft_shape != "none":
        draft = path if args.tiny else random_checkpoint(args.draft_shape, Path(args.root))
        args.draft_shape = "tiny (the target itself)" if args.tiny else args.draft_shape
        draft_rows += measure_proposer(path, {"method": "draft_model", "model": str(draft)}, args, workloads, base,
                                       rows)
        cleanup_dist_env_and_memory()
    if args.model_proposers:
        head = random_eagle3_head(path, draft_vocab=100 if args.tiny else 32000)
        draft_rows += measure_proposer(path, {"method": "eagle3", "model": str(head)}, args, workloads, base, rows)

    cost = {"ngram_lookup_256x1024_s": ngram_cost()}
    payload = {"benchmark": "spec_decode", "shape": shape, "device": device_name(), "commit": commit(), "date": now(),
               "prompt_len": args.prompt_len, "output_len": args.output_len,
               "disable_by_batch_size": args.disable_by_batch_size, "rows": rows, "proposer_cost": cost,
               "draft_shape": args.draft_shape, "draft_model_rows": draft_rows}
    write_result(f"spec-decode-{shape}", payload, args.out)
    print(f"\n{'workload':<12} {'k':>2} {'target':>6} {'length':>6} {'tok/s':>8} {'base':>8} {'x':>6} {'TPOT x':>7}")
    for row in rows:
        tpot = f"{row['tpot_ms'] / row['base_tpot_ms']:.3f}" if "tpot_ms" in row else ""
        print(f"{row['workload']:<12} {row['k']:>2} {row['target_length']:>6.2f} {row['length']:>6.2f} "
              f"{row['output_tok_s']:>8.0f} {row['base_output_tok_s']:>8.0f} {row['x_base']:>6.3f} {tpot:>7}")
    print(f"n-gram lookup, 256 requests x 1,024 tokens: {cost['ngram_lookup_256x1024_s'] * 1e3:.2f} ms")
    for row in draft_rows:
        projected = ", ".join(f"length {length}: {x:.3f}x" for length, x in row.get("projected_x_base", {}).items())
        name = f"draft_model ({args.draft_shape})" if row["method"] == "draft_model" else "eagle3 (random head)"
        print(f"{name}, {row['workload']}, k=4: proposer {row['draft_ms_per_step']:.2f} ms/step (follow "
              f"{row['follow_ms_per_step']:.2f}, propose {row['propose_ms_per_step']:.2f}), "
              f"{row['x_base']:.3f}x with its guesses; projected: {projected}")


if __name__ == "__main__":
    main()
