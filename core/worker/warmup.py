"""Start-up warm-up: synthetic steps through the real worker, so no request pays for a first use.

Triton compiles a kernel variant the first time a launch meets a new specialization: the
attention kernel's query tile follows the next power of two of the step's longest query (a
fresh prefill, a chunk after cached context and a decode each pick their own), its split-K
path follows the context length, and a pointer's 16-byte alignment (the rotary kernel's
positions sit after the token ids in the step's one input buffer: an odd token count moves
them) is part of the key. Compiling takes 0.1-1 s per variant; CUDA also loads library
kernels (cuBLAS, sort, top-k) on first use and uploads a CUDA graph on its first replay. Left
to the first requests, all of this lands in their time to first token.

The warm-up runs, once, steps that meet each of these: prefills of every power-of-two length,
chunks after cached context next to a decode, decodes at every batch size (each CUDA graph
bucket, and eager beyond the largest) and at power-of-two contexts, and each sampler path at
every alignment of its parameter table. The pooling runner samples nothing: its warm-up is the
prefills (and, unless the model is an encoder, the chunks after context), each one pooled, and a
step of several prompts pooled together.
The synthetic requests read and write KV blocks the block manager never lent (their contents
are never read by a real request before it writes them), are dropped from the runner at the
end, and the engine's sampling generator is restored, so the engine is as it was.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import numpy as np

from hookllm.worker.cuda_graph import batch_size_buckets
from hookllm.pooling_params import PoolingParams
from hookllm.sampling_params import SamplingParams
from hookllm.sched.output import NewRequestData, SchedulerOutput

if TYPE_CHECKING:
    from hookllm.worker.model_runner import StepOutput
    from hookllm.worker.worker import Worker

logger = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0)
# One of each sampler path: argmax, the noise race, the filter kernel's four variants (ranks
# and a nucleus, a nucleus alone with its split search, ranks alone, min-p alone), seeded noise,
# logprobs, and the penalty and bias stage.
SAMPLER_PATHS = (
    GREEDY,
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=0.8, top_k=20),
    SamplingParams(temperature=0.8, min_p=0.05),
    SamplingParams(temperature=1.0, seed=0),
    SamplingParams(temperature=0.0, logprobs=5),
    SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                   logit_bias={0: 1.0}),
)
PROMPT_LOGPROBS = SamplingParams(temperature=0.0, prompt_logprobs=5)
POOLED = PoolingParams(task="embed")
# The sampler's float32 table holds one row per parameter, each as long as the batch, so parameter
# row k starts 16-byte aligned when k * batch is a multiple of 4 (Triton compiles each alignment
# pattern apart): batches of 1, 2 and 4 rows meet every pattern (an odd batch aligns only the
# first row, 2 mod 4 every other row, a multiple of 4 all of them).
SAMPLER_BATCH_SIZES = (1, 2, 4)


@dataclass(frozen=True)
class Row:
    """One synthetic request of a step: ``context`` tokens already computed (a cached prefix or
    earlier chunks), ``query`` tokens scheduled, all of its prompt, so it samples."""

    context: int
    query: int
    params: SamplingParams | PoolingParams  # pooling params: the row is pooled, not sampled


@dataclass(frozen=True)
class Step:
    rows: tuple[Row, ...]
    # Then one more token each, its input still on the device (async scheduling's decode).
    then_decode: bool = False


def doubling(start: int, stop: int) -> list[int]:
    """``start``, twice that, ... while below ``stop``, then ``stop``; empty if ``stop < start``."""
    sizes = []
    size = start
    while size < stop:
        sizes.append(size)
        size *= 2
    return sizes + [stop] if stop >= start else []


def warmup_steps(max_num_batched_tokens: int, max_model_len: int, block_size: int,
                 decode_sizes: Iterable[int]) -> list[Step]:
    """The steps to run, decodes at each of ``decode_sizes`` requests: each step within the
    token budget, no sequence longer than the engine ever computes (``max_model_len - 1``)."""
    longest = max_model_len - 1
    budget = max_num_batched_tokens
    # One cached block before a chunk or a decode, as a prefix-cache hit leaves (less if the model is tiny).
    context = max(0, min(block_size, longest - 2))
    decode = Row(context, 1, GREEDY)
    # Fresh prefills: the query tile follows the next power of two of the longest query.
    steps = [Step((Row(0, q, GREEDY),)) for q in doubling(2, min(budget, longest))]
    # A chunk after cached context next to a decode: a mixed step, and an odd token count.
    steps += [Step((Row(context, q, GREEDY), decode)) for q in doubling(2, min(budget - 1, longest - context))]
    # Decodes at each batch size: every CUDA graph bucket, eager beyond the largest.
    steps += [Step((decode,) * n, then_decode=context + 2 <= longest) for n in decode_sizes if n <= budget]
    # One decode at sequence lengths 2^k: eager attention cuts longer contexts into more key ranges.
    steps += [Step((Row(length - 1, 1, GREEDY),)) for length in doubling(2 * block_size, longest)]
    # The sampler's paths, each alone in steps of SAMPLER_BATCH_SIZES rows (every alignment of its
    # parameter table), then all in one batch (as many as the budget holds); prompt logprobs.
    steps += [Step((Row(context, 1, params),) * rows) for params in SAMPLER_PATHS for rows in SAMPLER_BATCH_SIZES]
    every_path = tuple(Row(context, 1, params) for params in SAMPLER_PATHS)
    steps += [Step(every_path[start:start + budget]) for start in range(0, len(every_path), budget)]
    steps.append(Step((Row(0, min(block_size, longest), PROMPT_LOGPROBS),)))
    return steps


def pooling_warmup_steps(max_num_batched_tokens: int, max_model_len: int, block_size: int,
                         chunks: bool) -> list[Step]:
    """The pooling runner's steps: fresh prompts of every power-of-two length (a pooling prompt
    may fill ``max_model_len``), with ``chunks`` a chunk after cached context too, and four
    prompts in one step."""
    budget = max_num_batched_tokens
    steps = [Step((Row(0, q, POOLED),)) for q in doubling(2, min(budget, max_model_len))]
    if chunks:
        context = max(0, min(block_size, max_model_len - 2))
        steps += [Step((Row(context, q, POOLED),)) for q in doubling(2, min(budget, max_model_len - context))]
    several: list[Row] = []
    for query in (2, 3, 5, 7):
        if query <= max_model_len and sum(row.query for row in several) + query <= budget:
            several.append(Row(0, query, POOLED))
    return steps + [Step(tuple(several))]


def warm_up(worker: "Worker") -> float:
    """Run the warm-up steps on ``worker`` and log their time; returns the seconds taken.

    Call it on an idle worker (no request in the runner): the steps use the runner as a
    scheduler would, then drop their requests and restore the sampling generator."""
    start = time.perf_counter()
    config = worker.config
    graphs = worker.runner.cuda_graphs
    decode_sizes = sorted(set(batch_size_buckets(config.max_num_seqs)) | set(graphs.buckets if graphs else []))
    model_config = worker.model_config
    if model_config.runner == "pooling":
        steps = pooling_warmup_steps(config.max_num_batched_tokens, model_config.max_model_len, config.block_size,
                                     chunks=not model_config.encoder)
    else:
        steps = warmup_steps(config.max_num_batched_tokens, model_config.max_model_len, config.block_size,
                             decode_sizes)
    generator = worker.runner.generator
    state = generator.get_state()
    for index, step in enumerate(steps):
        _run_step(worker, step, f"warmup-{index}")
    generator.set_state(state)
    seconds = time.perf_counter() - start
    logger.info("warm-up: %d steps in %.2f s (turn it off with --no-warmup)", len(steps), seconds)
    return seconds


def _run_step(worker: "Worker", step: Step, prefix: str) -> None:
    """Run ``step`` (and its decode after), wait for its outputs, then drop its requests."""
    ids = [f"{prefix}-{i}" for i in range(len(step.rows))]
    pooled = isinstance(step.rows[0].params, PoolingParams)  # a step's rows are all pooled or all sampled
    new = [NewRequestData(request_id, [0] * (row.context + row.query), GREEDY if pooled else row.params,
                          pooling_params=row.params if pooled else None)
           for request_id, row in zip(ids, step.rows)]
    computed = [row.context for row in step.rows]
    counts = [row.query for row in step.rows]
    outputs = [worker.execute(_snapshot(ids, new, computed, counts, worker, pooled))]
    if step.then_decode:
        after = [c + n for c, n in zip(computed, counts)]
        outputs.append(worker.execute(_snapshot(ids, [], after, [1] * len(ids), worker), outputs[0]))
    for output in outputs:
        _wait(output)
    worker.execute(SchedulerOutput.empty(ids))


def _snapshot(ids: list[str], new: list[NewRequestData], computed: list[int], counts: list[int],
              worker: "Worker", pooled: bool = False) -> SchedulerOutput:
    """A step in which every request samples (its chunk reaches the end of what it has), or with
    ``pooled`` is pooled."""
    block_size, num_blocks = worker.config.block_size, worker.num_kv_blocks
    width = max(-(-(c + n) // block_size) for c, n in zip(computed, counts))
    # Every row of every KV cache group reads and writes the same blocks: their contents never
    # matter, only the shapes.
    table = np.tile(np.arange(width, dtype=np.int32) % num_blocks, (worker.kv_cache_groups.num_groups, 1))
    rows = list(range(len(ids)))
    return SchedulerOutput(new, ids, counts, computed, [[] for _ in ids], [] if pooled else rows,
                           [(row, 0, table) for row in rows], pooling_rows=rows if pooled else [])


def _wait(output: "StepOutput | None") -> None:
    """Read the step's tokens, logprobs and prompt logprobs back, as the engine does."""
    if output is not None:
        output.resolve()
        output.prompt_logprobs()
        output.pooled()
