"""Structured output cost: workload A with a quarter of the requests constrained by a JSON schema,
against the same workload unconstrained, on one engine in one run.

    python benchmarks/structured.py --shape llama-3.2-1b --out DIR

The random checkpoint has no tokenizer, so a byte-level BPE (``--tokenizer-vocab`` ids, trained
offline on the Python sources of the installed torch package; EOS ``</s>`` = id 2 as the Llama
config says) is saved next to a link to its weights. Ids past the tokenizer's are never allowed in
constrained rows. The schema, an array of strings without ``maxItems``, lets a constrained request
run to its ``max_tokens`` (with ``ignore_eos``: once the array closes only EOS is allowed), so
both runs produce the same token counts; the counts reported are the outputs' actual ones.
Reported: output tok/s of both runs (with ``--repeat N``, N interleaved pairs, the median call
of each) and their ratio (goal >= 0.9); per constrained step, the host times of the plugin's
job (see ``MaskTimer``): sending the step to the matcher process, the main thread's waits for
the job and for the reply, the round trip and the process's own work. CPU smoke test:

    python benchmarks/structured.py --tiny --num-requests 8 --max-prompt 32 --max-output 24 --out /tmp/x
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (add_out_argument, commit, device_name, now, random_checkpoint, synchronize,  # noqa: E402
                    write_result)
from throughput import workload_a  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "string"}}


def train_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE saved into ``path``: <unk>, <s> (BOS, 1), </s> (EOS, 2), then merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(Path(torch.__file__).parent.rglob("*.py"))
    corpus = (f.read_text(errors="ignore") for f in files[:3000])
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(path))


def checkpoint_with_tokenizer(args) -> Path:
    """The benchmark's checkpoint folder: the shared random checkpoint's files linked, plus a tokenizer."""
    if args.tiny:
        from hookllm import testing

        path = Path(args.root) / "tiny-structured"
        if not (path / "config.json").exists():
            testing.build_tiny_checkpoint(testing.tiny_llama_config(), path)
            testing.build_tiny_tokenizer(path)
        return path
    source = random_checkpoint(args.shape, Path(args.root))
    path = Path(args.root) / f"{args.shape}-structured-{args.tokenizer_vocab}"
    if not (path / "tokenizer.json").exists():
        path.mkdir(parents=True, exist_ok=True)
        for f in source.iterdir():  # link, not copy: the other benchmarks keep a tokenizer-less folder
            if not (path / f.name).exists():
                (path / f.name).symlink_to(f.resolve())
        train_tokenizer(path, args.tokenizer_vocab)
    return path


class MaskTimer:
    """Per constrained step, the host times of the structured plugin's job:

    - ``send``: building and sending the matcher process's message (``MaskJob._send``: on the
      main thread when the previous step's tokens are read, ``tokens_ready``, or in the job
      thread's ``run``, whichever comes first);
    - ``main_wait``: for a deferred step, how long the main thread waited for that ``run`` when
      it finished the step (from ``StepOutput.finish`` to ``MaskJob.apply``);
    - ``apply``: ``MaskJob.apply`` on the main thread: reading the process's reply (waiting for it
      if it is not there yet), copying the masks out, launching the masking;
    - ``round_trip``: from sending the message to having read the reply, and within it
      ``process``, the matcher process's own work (advancing the matchers, filling the masks).
    """

    def __init__(self):
        from hookllm.worker.model_runner import StepOutput
        from hookllm.bundled.structured import backend

        self.reset()
        send_job, apply, finish = backend.MaskJob._send, backend.MaskJob.apply, StepOutput.finish
        send, receive = backend.MatcherProcess.send_step, backend.MatcherProcess.receive_step
        finishing: list[float] = []  # when the main thread started finishing a deferred step
        sent: list[float] = []  # when the step in flight was sent

        def timed_send_job(job):
            start = time.perf_counter()
            send_job(job)
            self.sends.append(time.perf_counter() - start)
            self.rows.append(len(job.rows))

        def timed_finish(step):
            if not step.is_deferred:
                return finish(step)
            finishing.append(time.perf_counter())
            try:
                return finish(step)
            finally:
                finishing.clear()

        def timed_apply(job, logits):
            start = time.perf_counter()
            if finishing:  # a deferred step: the main thread has waited for its job until now
                self.main_waits.append(start - finishing[0])
            apply(job, logits)
            self.applies.append(time.perf_counter() - start)

        def timed_send(process, *args):
            send(process, *args)
            sent[:] = [time.perf_counter()]

        def timed_receive(process):
            result = receive(process)
            self.round_trips.append(time.perf_counter() - sent[0])
            self.process_steps.append(process.last_step_seconds)
            return result

        backend.MaskJob._send, backend.MaskJob.apply = timed_send_job, timed_apply
        backend.MatcherProcess.send_step, backend.MatcherProcess.receive_step = timed_send, timed_receive
        StepOutput.finish = timed_finish

    def reset(self) -> None:
        self.sends: list[float] = []
        self.main_waits: list[float] = []
        self.applies: list[float] = []
        self.round_trips: list[float] = []
        self.process_steps: list[float] = []
        self.rows: list[int] = []

    def summary(self) -> dict:
        def ms(values: list[float]) -> float:
            return 1e3 * statistics.fmean(values or [0.0])

        return {"steps": len(self.sends), "deferred_steps": len(self.main_waits),
                "send_ms_per_step_mean": ms(self.sends),
                "main_wait_ms_per_deferred_step_mean": ms(self.main_waits),
                "main_wait_ms_per_deferred_step_max": 1e3 * max(self.main_waits or [0.0]),
                "apply_ms_per_step_mean": ms(self.applies),
                "round_trip_ms_per_step_mean": ms(self.round_trips),
                "process_ms_per_step_mean": ms(self.process_steps),
                "constrained_rows_per_step_mean": statistics.fmean(self.rows or [0])}


def run(llm, prompts, params, name: str) -> dict:
    llm.reset_prefix_cache()  # every call computes its prompts, as the first does: no call finds them cached
    synchronize()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{name}: {tokens / seconds:.0f} output tok/s, {seconds:.1f}s", flush=True)
    return {"output_tok_s": tokens / seconds, "output_tokens": tokens, "wall_s": seconds}


def median_call(runs: list[dict]) -> dict:
    """The call of median throughput (the lower middle one for an even count)."""
    return sorted(runs, key=lambda r: r["output_tok_s"])[(len(runs) - 1) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b", choices=["llama-3.2-1b", "qwen3-0.6b", "llama-3.1-8b"])
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama on the CPU (smoke test)")
    parser.add_argument("--root", default="/tmp/hookllm-bench")
    parser.add_argument("--tokenizer-vocab", type=int, default=32000)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--constrained-every", type=int, default=4, help="every k-th request is constrained")
    parser.add_argument("--max-prompt", type=int, default=None, help="cap prompt lengths (smoke tests)")
    parser.add_argument("--max-output", type=int, default=None, help="cap max_tokens (smoke tests)")
    parser.add_argument("--repeat", type=int, default=1, help="pairs of runs (unconstrained, constrained); "
                        "the median call of each is reported")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    add_out_argument(parser)
    args = parser.parse_args()

    from hookllm import LLM, SamplingParams
    from hookllm.sampling_params import StructuredOutputsParams

    path = checkpoint_with_tokenizer(args)
    # The tiny run forces async scheduling (the CUDA default), so it takes the same path as the GPU run.
    kwargs = (dict(device="cpu", dtype="float32", async_scheduling=True) if args.tiny
              else dict(max_model_len=2048 + 64))
    llm = LLM(str(path), plugins=["structured"], max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, **kwargs)
    vocab = llm.engine.model_config.hf_config.vocab_size
    prompts, max_tokens = workload_a(args.num_requests)
    prompts = [[t % vocab for t in p[:args.max_prompt]] for p in prompts]
    max_tokens = [min(n, args.max_output or n) for n in max_tokens]
    constrained = StructuredOutputsParams(json=SCHEMA)
    # Warm-up: CUDA graphs, the LLTokenizer (built once per tokenizer), the matchers' thread pool.
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=8, structured_outputs=constrained),
                 use_tqdm=False)

    def params(with_constraints: bool) -> list[SamplingParams]:
        return [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n,
                               structured_outputs=constrained if with_constraints and i % args.constrained_every == 0
                               else None) for i, n in enumerate(max_tokens)]

    # Pairs of runs, interleaved, so that drift of the machine falls on both sides alike.
    calls: dict[str, list[dict]] = {"unconstrained": [], "constrained": []}
    timer = None
    for _ in range(args.repeat):
        calls["unconstrained"].append(run(llm, prompts, params(False), "unconstrained"))
        if timer is None:
            timer = MaskTimer()  # only from the first constrained run on: its small cost counts against it
        timer.reset()
        calls["constrained"].append(run(llm, prompts, params(True), f"1/{args.constrained_every} constrained"))
        calls["constrained"][-1].update(timer.summary())
    results = {name: dict(median_call(runs), calls=runs) for name, runs in calls.items()}
    ratio = results["constrained"]["output_tok_s"] / results["unconstrained"]["output_tok_s"]
    payload = {"device": device_name(), "date": now(), "commit": commit(), "model": "tiny" if args.tiny else args.shape,
               "workload": f"A: {args.num_requests} requests, ignore_eos, temperature 0.6; every "
                           f"{args.constrained_every}th constrained by {SCHEMA}",
               "tokenizer_vocab": len(llm.get_tokenizer()), "results": results, "throughput_ratio": ratio}
    out = write_result(f"structured-{payload['model']}", payload, args.out)
    c = results["constrained"]
    print(f"\nwrote {out}")
    print(f"{'run':<16}{'output tok/s':>14}{'wall s':>9}{'send':>8}{'wait':>8}{'apply':>8}{'round trip':>12}"
          f"{'process':>9}{'deferred':>11}{'rows/step':>11}")
    print(f"{'unconstrained':<16}{results['unconstrained']['output_tok_s']:>14.0f}"
          f"{results['unconstrained']['wall_s']:>9.1f}")
    print(f"{'constrained':<16}{c['output_tok_s']:>14.0f}{c['wall_s']:>9.1f}{c['send_ms_per_step_mean']:>8.3f}"
          f"{c['main_wait_ms_per_deferred_step_mean']:>8.3f}{c['apply_ms_per_step_mean']:>8.3f}"
          f"{c['round_trip_ms_per_step_mean']:>12.3f}{c['process_ms_per_step_mean']:>9.3f}"
          f"{c['deferred_steps']:>6}/{c['steps']:<4}{c['constrained_rows_per_step_mean']:>11.1f}")
    print("(ms per constrained step: send = building and sending the step's message; wait = the main thread"
          " waiting for the job's run; apply = the main thread reading the reply and masking; process = the"
          " matcher process's work)")
    print(f"throughput ratio constrained / unconstrained: {ratio:.3f} (goal >= 0.90)")


if __name__ == "__main__":
    main()
