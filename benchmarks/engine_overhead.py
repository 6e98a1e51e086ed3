"""The engine's host cost per output token, without the model: a one-layer tiny model on the CPU.

For 256 requests of 64 tokens, reports the wall time of ``LLMEngine.step`` minus the worker's
``execute`` (scheduling, output processing, detokenizing) per token, offline (final outputs)
and streamed (delta outputs); and, for the streamed run, what a step's report costs to cross
the engine process's pipe (``pack_output``, msgpack encode and decode) per token. Minimum of
``--repeat`` runs; ``--logprobs N`` asks every request for N logprobs. Runs anywhere:
``python benchmarks/engine_overhead.py``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from hookllm import EngineConfig, LLMEngine, SamplingParams, testing  # noqa: E402
from hookllm.engine.messages import EngineReport, decode_report, encode_report, pack_output  # noqa: E402
from hookllm.worker.worker import Worker  # noqa: E402


def run(engine: LLMEngine, prompts: list[list[int]], output_kind: str, tag: str,
        logprobs: int | None = None) -> tuple[float, float]:
    """(engine host us/token, report wire us/token) for one pass over ``prompts``."""
    execute_s = [0.0]
    real_execute = Worker.execute

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return real_execute(self, *args, **kwargs)
        finally:
            execute_s[0] += time.perf_counter() - start

    Worker.execute = timed
    try:
        params = SamplingParams(max_tokens=64, ignore_eos=True, seed=1, output_kind=output_kind, logprobs=logprobs)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", prompt, params)
        wire_s, tokens, heads = 0.0, 0, set()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            outputs = engine.step()
            wire_start = time.perf_counter()
            report = EngineReport(engine.get_stats(), [pack_output(o, o.request_id not in heads) for o in outputs])
            heads.update(o.request_id for o in outputs)
            decode_report(encode_report(report))
            wire_s += time.perf_counter() - wire_start
            tokens += sum(len(o.outputs[0].token_ids) for o in outputs) if output_kind == "delta" else \
                sum(len(o.outputs[0].token_ids) for o in outputs if o.finished)
        wall_s = time.perf_counter() - start
    finally:
        Worker.execute = real_execute
    return (wall_s - execute_s[0] - wire_s) / tokens * 1e6, wire_s / tokens * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--logprobs", type=int, default=None, help="every request's logprobs (default: none)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = tempfile.mkdtemp()
    config = testing.tiny_llama_config(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                       num_attention_heads=2, num_key_value_heads=1)
    testing.build_tiny_checkpoint(config, folder)
    testing.build_tiny_tokenizer(folder)
    engine = LLMEngine(EngineConfig(model=folder, device="cpu", dtype="float32", max_num_seqs=256,
                                    num_kv_blocks=4096))
    prompts = testing.random_prompts(256, 300, 8, 16)
    for kind in ("final_only", "delta"):
        host, wire = zip(*(run(engine, prompts, kind, f"{kind}-{r}", args.logprobs) for r in range(args.repeat)))
        wire_text = f", report pack + encode + decode {min(wire):.2f}" if kind == "delta" else ""
        print(f"{kind:>10}: engine host {min(host):.2f} us/token{wire_text}")


if __name__ == "__main__":
    main()
