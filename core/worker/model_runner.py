"""Turns a SchedulerOutput into flat model inputs, runs the model, and samples.

The runner keeps a :class:`hookllm.worker.batch.CachedRequestState` per request, rebuilt from the snapshots
alone: a request's prompt and sampling parameters arrive once, then each step's counts and the
output tokens it was not sent yet; a running request also has a row of the persistent batch
(:mod:`hookllm.worker.input_batch`: block tables, sampler parameters), to which a step applies
only the block ids the tables lack. The per-step path: build inputs on the host in bulk (numpy),
copy them once, merge a multimodal model's item embeddings (:mod:`hookllm.multimodal.encoder_cache`),
let plugins adjust them (``prepare_inputs``), run the model under the attention
metadata, compute logits only for rows that sample, then ``process_logits`` and ``sample``. The
sampled token ids are the one value read back from the device each step.

Plugins' ``LogitsJob``s (``start_logits_job``) run before ``process_logits``. While a step is in
flight (async scheduling), a step with jobs is deferred: the jobs run in a background thread and
the step samples when it is finished, at the start of the next ``execute`` or when its tokens
are read, so the jobs' host work overlaps the engine's output processing and scheduling.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from types import ModuleType
from typing import Callable

import numpy as np
import torch
from torch import nn

from hookllm.kernels import ops_for
from hookllm.lora.manager import LoRAManager
from hookllm.multimodal.encoder_cache import EncoderRunner
from hookllm.plugins.contract import capability, is_multimodal
from hookllm.worker.batch import Batch, LogitsJob, CachedRequestState
from hookllm.worker.cuda_graph import CudaGraphRunner
from hookllm.worker.forward_context import AttentionMetadata, set_forward_context
from hookllm.worker.input_batch import InputBatch
from hookllm.worker.pooler import Pooler
from hookllm.outputs import LogprobsRow
from hookllm.worker.penalties import AdjustedRows, LogitsAdjuster
from hookllm.worker.pipeline_stage import PipelineStage
from hookllm.plugins.manager import ActiveHooks
from hookllm.sched.output import SchedulerOutput
from hookllm.spec.draft_kv import DraftKV
from hookllm.spec.proposer import ProposalBatch, StepTokens
from hookllm.spec.verify import (SpecDecoder, SpecDecodeOutput, num_verified_rows, runs_ending_at, takes_drafts,
                                 verified_row_starts)
from hookllm.utils import to_device_async


@dataclass
class ModelInputs:
    """The flat batch of one step; ``prepare_inputs`` hooks may change it in place."""

    input_ids: torch.Tensor  # [num_tokens] long
    positions: torch.Tensor  # [num_tokens] long
    # Per KV cache group (hookllm.worker.kv_cache_groups): one group is the single table of a
    # model whose layers all read the same blocks.
    slot_mapping: torch.Tensor  # [num_groups, num_tokens] long
    block_tables: torch.Tensor  # [num_groups, num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    logits_indices: torch.Tensor  # [num_sampling_rows] long: rows whose hidden state is sampled
    query_start: list[int]  # host copy of query_start_loc, for hooks
    max_query_len: int
    max_seq_len: int
    inputs_embeds: torch.Tensor | None = None  # [num_tokens, hidden]: replaces input_ids if set
    token_type_ids: torch.Tensor | None = None  # [num_tokens] long: text pairs' segments, for encoders that read them

    def attention_metadata(self, backend: ModuleType) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping.unbind(), block_tables=self.block_tables.unbind(), seq_lens=self.seq_lens,
            query_start_loc=self.query_start_loc, max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len, backend=backend, token_type_ids=self.token_type_ids,
        )


@dataclass
class SampledTokens:
    """What sampling a step leaves on the device."""

    token_ids: torch.Tensor  # [num_sampling_rows] long
    logprobs: tuple[torch.Tensor, ...] | None = None  # chosen token's logprob, its rank, top-n values, top-n ids
    wanted: list[int | None] | None = None  # each row's n (None: not asked)


class StepOutput:
    """A launched step's sampled token ids (and logprobs): copied to the host without waiting,
    read by ``resolve``, which waits for the device only if the step is still running.

    A deferred step is made with ``deferred``, the function that samples it, and the ``device``
    its tokens live on, instead of its tokens: ``finish`` calls it once, on the runner's thread,
    and every reader finishes first.
    """

    def __init__(self, request_ids: list[str], sampled: SampledTokens | None = None,
                 prompt_logprobs: dict[str, tuple[torch.Tensor, ...]] | None = None,
                 deferred: Callable[[], SampledTokens] | None = None, device: torch.device | None = None,
                 pooled: dict[str, torch.Tensor] | None = None):
        self.request_ids = request_ids  # the request of each row
        self._rows: dict[str, int] | None = None  # row_of's index, built on first use
        # By request: (prompt tokens' logprobs, ranks, top-k values, top-k ids) for this step's chunk.
        self._prompt_logprobs = {request_id: tuple(t.to("cpu", non_blocking=True) for t in parts)
                                 for request_id, parts in (prompt_logprobs or {}).items()}
        # By request: the pooled hidden states of each pooling request whose prompt this step completed.
        self._pooled = host_copies(pooled or {})
        self._deferred = deferred
        self._device = device
        self._when_resolved: list[Callable[[], None]] = []  # called once, when the tokens reach the host
        self.spec: SpecDecodeOutput | None = None  # a speculating step's, once verified
        if sampled is not None:
            self._copy_to_host(sampled)

    @property
    def is_deferred(self) -> bool:
        """Whether the step still waits for its logits jobs to be sampled."""
        return self._deferred is not None

    def finish(self) -> None:
        """Sample a deferred step now (a no-op otherwise). If that raises, the step keeps token 0
        in every row, so the engine can go on once the caller has failed the step's requests."""
        if self._deferred is None:
            return
        deferred, self._deferred = self._deferred, None
        try:
            sampled = deferred()
        except BaseException:
            placeholder = torch.zeros(len(self.request_ids), dtype=torch.long, device=self._device)
            self._copy_to_host(SampledTokens(placeholder))
            raise
        self._copy_to_host(sampled)

    def _copy_to_host(self, sampled: SampledTokens) -> None:
        self._device_sampled = sampled.token_ids
        self._sampled = sampled.token_ids.to("cpu", non_blocking=True)
        self._logprobs = tuple(t.to("cpu", non_blocking=True) for t in sampled.logprobs) if sampled.logprobs else None
        self._wanted = sampled.wanted
        self._done = None
        if sampled.token_ids.is_cuda:
            self._done = torch.cuda.Event()
            self._done.record()

    @property
    def sampled(self) -> torch.Tensor:
        """The sampled ids on the device: the next step reads its in-flight tokens from here."""
        self.finish()
        return self._device_sampled

    def when_resolved(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once this step's tokens are read on the host (``token_ids``)."""
        self._when_resolved.append(callback)

    def token_ids(self) -> list[int]:
        """The sampled token ids, waiting for this step only if it is still running."""
        self.finish()
        if self._done is not None:
            self._done.synchronize()
        callbacks, self._when_resolved = self._when_resolved, []
        for callback in callbacks:
            callback()
        return self._sampled.tolist()

    def row_of(self, request_id: str) -> int:
        """The row that sampled ``request_id``'s token."""
        if self._rows is None:
            self._rows = {request_id: row for row, request_id in enumerate(self.request_ids)}
        return self._rows[request_id]

    def token_ids_by_request(self) -> dict[str, int]:
        return dict(zip(self.request_ids, self.token_ids()))

    def resolve(self) -> tuple[list[int], list[LogprobsRow | None]]:
        """One token id per sampling row and its logprobs row (None if not asked)."""
        token_ids = self.token_ids()
        if self._logprobs is None:
            return token_ids, [None] * len(token_ids)
        return token_ids, logprobs_rows(token_ids, *self._logprobs, self._wanted)

    def pooled(self) -> dict[str, torch.Tensor]:
        """By request: a completed pooling request's output, on the host (float32)."""
        self.finish()
        if self._pooled and self._done is not None:
            self._done.synchronize()
        return self._pooled

    def spec_decode(self) -> SpecDecodeOutput | None:
        """A speculating step's emitted tokens and next drafts, per sampling request."""
        return self.spec

    def prompt_logprobs(self) -> dict[str, list[LogprobsRow]]:
        """By request: one row per prompt token this step predicted (its chunk's next tokens)."""
        self.finish()
        if self._prompt_logprobs and self._done is not None:
            self._done.synchronize()
        resolved = {}
        for request_id, (targets, *parts) in self._prompt_logprobs.items():
            resolved[request_id] = logprobs_rows(targets.tolist(), *parts, [parts[-1].shape[-1]] * len(targets))
        return resolved


def logprobs_rows(token_ids: list[int], chosen: torch.Tensor, ranks: torch.Tensor, top_values: torch.Tensor,
                  top_ids: torch.Tensor, wanted: list[int | None]) -> list[LogprobsRow | None]:
    """Each row's token with its logprob and rank, then its top ``n`` (ranks 1..n), from a step's
    host tensors: a few array operations and one ``tolist`` each, whatever the batch."""
    num_rows, k = top_ids.shape
    ids = np.concatenate([np.asarray(token_ids, dtype=np.int64)[:, None], top_ids.numpy()], axis=1).tolist()
    values = np.concatenate([chosen.numpy()[:, None], top_values.numpy()], axis=1).tolist()
    top_ranks = np.broadcast_to(np.arange(1, k + 1), (num_rows, k))
    rank_lists = np.concatenate([ranks.numpy()[:, None], top_ranks], axis=1).tolist()
    return [None if n is None else (i, v, r) if n == k else (i[:n + 1], v[:n + 1], r[:n + 1])
            for i, v, r, n in zip(ids, values, rank_lists, wanted)]


def host_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float32 device tensors on the host, in one copy (not one per request): joined flat on
    the device, copied without waiting, and split back into views of their shapes."""
    if not tensors:
        return {}
    flat = torch.cat([t.reshape(-1).float() for t in tensors.values()]).to("cpu", non_blocking=True)
    parts = flat.split([t.numel() for t in tensors.values()])
    return {key: part.view(t.shape) for (key, t), part in zip(tensors.items(), parts)}


class SamplerContractError(RuntimeError):
    pass


class ModelRunner:
    def __init__(self, model: nn.Module, hooks: ActiveHooks, device: torch.device, block_size: int,
                 attention_backend: ModuleType, seed: int, input_batch: InputBatch, pooler: Pooler | None = None):
        self.model = model
        self.hooks = hooks
        self.device = device
        self.block_size = block_size
        self.attention_backend = attention_backend
        self.cuda_graphs: CudaGraphRunner | None = None  # set by the worker unless enforce_eager
        self.stage: PipelineStage | None = None  # set by the worker under pipeline parallelism
        self.lora: LoRAManager | None = None  # set by the worker with enable_lora
        self.spec: SpecDecoder | None = None  # set by the worker with speculative_config
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = input_batch  # the rows of the requests the runner has run and may run next
        self.pooler = pooler  # the pooling runner's (hookllm.worker.pooler); None when generating
        # An encoder reading token types (BERT's): a text pair's second text is of type 1.
        self.uses_token_types = bool(capability(model, "uses_token_types"))
        # Penalties, logit bias, allowed tokens, bad words: device state for the requests using them.
        self.logits_adjuster = LogitsAdjuster(device)
        # Requests whose prompt logprobs are not all computed yet: the first prompt position whose
        # logprob is not reported (a chunk recomputed after a preemption reports nothing twice).
        self.prompt_logprob_ids: dict[str, int] = {}
        self.job_thread: ThreadPoolExecutor | None = None  # runs deferred steps' logits jobs
        # A multimodal model's encoder and its cache (hookllm.multimodal.encoder_cache).
        self.encoder = EncoderRunner(model) if is_multimodal(type(model)) else None

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Drop finished requests, add new ones, and apply the step's counts and new tokens.
        Finished and preempted requests give their rows back."""
        for request_id in scheduler_output.preempted_request_ids:
            self.input_batch.remove(request_id)
        for request_id in scheduler_output.finished_request_ids:
            self.input_batch.remove(request_id)
            if self.pooler is not None:
                self.pooler.remove(request_id)
            state = self.requests.pop(request_id, None)
            if state is not None:
                self.hooks.hook.worker_request_finished(request=state, model=self.model, context=self.hooks.context)
                if self.encoder is not None:
                    self.encoder.release(state)
            self.logits_adjuster.remove(request_id)
            self.prompt_logprob_ids.pop(request_id, None)
        for new in scheduler_output.new_requests:
            self.requests[new.request_id] = CachedRequestState(
                new.request_id, list(new.prompt_token_ids), len(new.prompt_token_ids), new.sampling_params,
                list(new.mm_items), pooling_params=new.pooling_params, lora_request=new.lora_request)
            self.logits_adjuster.add(self.requests[new.request_id])
            if new.lora_request is not None and self.lora is not None:
                self.lora.add_adapter(new.lora_request)
            if new.sampling_params.prompt_logprobs is not None:
                self.prompt_logprob_ids[new.request_id] = 0
        # Speculative decoding: the new tokens also join the rows of token ids the proposer reads.
        row_of = self.input_batch.row_of if self.input_batch.keeps_token_ids else {}
        rows, starts, written = [], [], []
        for request_id, computed, new_tokens in zip(scheduler_output.request_ids, scheduler_output.num_computed_tokens,
                                                    scheduler_output.new_token_ids):
            state = self.requests[request_id]
            state.num_computed_tokens = computed
            if new_tokens and request_id in row_of:
                rows.append(row_of[request_id])
                starts.append(len(state.all_token_ids))
                written.append(new_tokens)
            state.all_token_ids += new_tokens
        if rows:
            self.input_batch.write_token_ids(np.asarray(rows, dtype=np.int64), np.asarray(starts, dtype=np.int64),
                                             written)

    def make_batch(self, scheduler_output: SchedulerOutput, previous: StepOutput | None) -> Batch:
        requests = [self.requests[request_id] for request_id in scheduler_output.request_ids]
        counts = scheduler_output.num_scheduled_tokens
        sampling = scheduler_output.sampling_rows
        rows = self.input_batch.rows(scheduler_output.request_ids, self.requests)
        positions = [requests[row].num_computed_tokens + counts[row] for row in sampling]
        drafts = scheduler_output.spec_token_ids
        if not drafts:
            return Batch(requests, counts, [requests[row] for row in sampling], positions, self.generator, previous,
                         rows, self.input_batch.sampler_table[:, rows[sampling]])
        # A request verifying k drafts samples k + 1 rows, at the positions of the tokens they predict.
        sampling_requests = [requests[row] for row in sampling]
        verified = [drafts.get(request.request_id, []) for request in sampling_requests]
        repeats = num_verified_rows(verified)
        expanded = np.repeat(np.arange(len(sampling)), repeats)
        row_positions = runs_ending_at(np.asarray(positions, dtype=np.int64), repeats)
        return Batch(requests, counts, [sampling_requests[i] for i in expanded.tolist()], row_positions.tolist(),
                     self.generator, previous, rows,
                     self.input_batch.sampler_table[:, rows[np.asarray(sampling, dtype=np.int64)[expanded]]],
                     spec_token_ids=verified)

    def build_inputs(self, batch: Batch, scheduler_output: SchedulerOutput) -> ModelInputs:
        requests, counts_list = batch.requests, batch.num_scheduled_tokens
        counts = np.asarray(counts_list, dtype=np.int64)
        starts = np.asarray(scheduler_output.num_computed_tokens, dtype=np.int64)
        num_seqs = len(counts_list)
        query_start = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start[1:])
        num_tokens = int(query_start[-1])
        # A row's token ids are known on the host up to its request's length; with async
        # scheduling its last one may be the token the step still on the device samples.
        lengths = np.fromiter(map(len, [r.all_token_ids for r in requests]), dtype=np.int64, count=num_seqs)
        drafts = scheduler_output.spec_token_ids  # speculative decoding: known too, after the request's tokens
        if drafts:
            lengths += [len(drafts.get(r.request_id, ())) for r in requests]
        known = np.minimum(np.maximum(lengths - starts, 0), counts)
        pending = np.flatnonzero(known < counts)  # rows whose last input is in flight
        token_ids: list[int] = []
        for row in np.flatnonzero(known).tolist():  # none in a decode step with a step in flight
            start, count, history = int(starts[row]), int(known[row]), requests[row].all_token_ids
            taken = history[start:start + count]
            token_ids += taken
            if len(taken) < count:  # the rest are its drafts (which follow a decoding request's last token)
                token_ids += drafts[requests[row].request_id][:count - len(taken)]
        input_ids = np.zeros(num_tokens, dtype=np.int64)
        pending_slots = query_start[1:][pending] - 1
        sources = pending  # the rows of the step in flight that sampled them
        in_order = True
        if len(pending):
            is_known = np.ones(num_tokens, dtype=bool)
            is_known[pending_slots] = False
            input_ids[is_known] = token_ids
            pending_ids = [scheduler_output.request_ids[row] for row in pending.tolist()]
            # The step in flight sampled those tokens in its own row order: usually this one's.
            in_order = pending_ids == batch.previous.request_ids
            if not in_order:
                sources = np.asarray([batch.previous.row_of(request_id) for request_id in pending_ids], dtype=np.int64)
        else:
            input_ids[:] = token_ids
        seq_lens = starts + counts
        # positions: for each request, start .. start + count - 1, laid out flat.
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_start[:-1] - starts, counts)
        input_batch = self.input_batch
        table_updates = input_batch.update_block_tables(batch.rows, scheduler_output.block_updates)
        width = int(input_batch.num_blocks[batch.rows].max())
        # [num_groups, num_tokens]: every group's slots in one gather from the persistent tables.
        slot_mapping = input_batch.slot_mapping(np.repeat(batch.rows, counts), positions, self.block_size)
        if slot_mapping.shape[0] > 1 and num_tokens % 2:
            # An even token count keeps every group's plane 16-byte aligned on the device, as the
            # first always is: Triton compiles a kernel variant per pointer alignment.
            slot_mapping = np.pad(slot_mapping, ((0, 0), (0, 1)))
        logits_indices = query_start[1:][np.asarray(scheduler_output.sampling_rows, dtype=np.int64)] - 1
        if batch.spec_token_ids is not None:  # a request verifying k drafts samples its last k + 1 rows
            logits_indices = runs_ending_at(logits_indices, num_verified_rows(batch.spec_token_ids))
        token_types = self._token_types(requests, counts, positions)
        lora_mapping = (self.lora.prepare_step(input_batch.lora_ids[batch.rows], counts)
                        if self.lora is not None else positions[:0])
        # One host->device copy for the whole step (pinned, asynchronous on CUDA).
        parts = [input_ids, positions, slot_mapping.ravel(), logits_indices, seq_lens, query_start, batch.rows,
                 table_updates.ravel(), pending_slots, sources, token_types, lora_mapping]
        flat = to_device_async(torch.from_numpy(np.concatenate(parts)), self.device)
        (input_ids_t, positions_t, slots_t, logits_t, seq_lens_t, query_start_t, rows_t, table_updates_t,
         slots_in_flight, sources_t, token_types_t, lora_mapping_t) = flat.split([len(part) for part in parts])
        input_batch.apply_device_updates(table_updates_t.view(2, -1))
        if self.lora is not None:
            self.lora.apply_step(lora_mapping_t)
        if len(pending) == num_tokens and in_order:
            # Every input is the step in flight's token, in its row order (async decode): its
            # sampled ids are the input ids as they are (the model and its graphs only read them).
            input_ids_t = batch.previous.sampled
        elif len(pending):
            input_ids_t[slots_in_flight] = batch.previous.sampled[sources_t]
        return ModelInputs(
            input_ids=input_ids_t,
            positions=positions_t,
            slot_mapping=slots_t.view(slot_mapping.shape)[:, :num_tokens],
            block_tables=input_batch.device_block_tables(rows_t, width),
            seq_lens=seq_lens_t.to(torch.int32),
            query_start_loc=query_start_t.to(torch.int32),
            logits_indices=logits_t,
            query_start=query_start.tolist(),
            max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()),
            token_type_ids=token_types_t if len(token_types) else None,
        )

    def _token_types(self, requests: list[CachedRequestState], counts: np.ndarray,
                     positions: np.ndarray) -> np.ndarray:
        """Each token's type (1 from a text pair's second text on) when the model reads token
        types and the step holds a pair; else empty."""
        if not self.uses_token_types:
            return positions[:0]
        starts = [r.pooling_params.second_text_start if r.pooling_params is not None else None for r in requests]
        if all(start is None for start in starts):
            return positions[:0]
        never = np.iinfo(np.int64).max
        starts_arr = np.asarray([never if start is None else start for start in starts], dtype=np.int64)
        return (positions >= np.repeat(starts_arr, counts)).astype(np.int64)

    @torch.inference_mode()
    def forward(self, batch: Batch, scheduler_output: SchedulerOutput) -> tuple[torch.Tensor, ModelInputs]:
        """Build the inputs, let plugins adjust them, run the model: hidden states of every row."""
        inputs = self.build_inputs(batch, scheduler_output)
        if self.encoder is not None:
            inputs.inputs_embeds = self.encoder.input_embeddings(batch.requests, batch.num_scheduled_tokens,
                                                                 inputs.query_start, inputs.input_ids)
        self.hooks.hook.prepare_inputs(batch=batch, inputs=inputs, model=self.model, context=self.hooks.context)
        if self.stage is not None:
            return self._forward_stage(inputs), inputs
        graphs = self.cuda_graphs
        if (graphs is not None and inputs.inputs_embeds is None and inputs.token_type_ids is None
                and graphs.can_run(inputs.input_ids.shape[0], len(batch.requests), inputs.max_query_len,
                                   inputs.block_tables.shape[2])):
            hidden_states = graphs.run(inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.block_tables,
                                       inputs.seq_lens, inputs.query_start_loc, inputs.max_query_len)
            return hidden_states, inputs
        with set_forward_context(inputs.attention_metadata(self.attention_backend)):
            hidden_states = self.model(inputs.input_ids, inputs.positions, inputs.inputs_embeds)
        return hidden_states, inputs

    def _forward_stage(self, inputs: ModelInputs) -> torch.Tensor:
        """One pipeline stage's forward: the previous stage's output in, this one's out to the next."""
        stage = self.stage
        intermediate = None if stage.is_first else stage.receive(inputs.positions.shape[0])
        with set_forward_context(inputs.attention_metadata(self.attention_backend)):
            hidden_states = self.model(inputs.input_ids, inputs.positions, inputs.inputs_embeds,
                                       intermediate_tensors=intermediate)
        if not stage.is_last:
            stage.send(hidden_states)
        return hidden_states

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput, previous: StepOutput | None = None) -> StepOutput | None:
        """Run one step: None when it samples nothing (no forward at all when nothing is scheduled).

        ``previous`` is the step still on the device (async scheduling): requests whose next
        input token it sampled read that token from its output, on the device. A step with
        logits jobs and a step in flight is deferred (see :meth:`_sample_after_jobs`).
        """
        try:
            if previous is not None:
                previous.finish()  # a deferred step samples before any request state changes
        finally:
            self.update_states(scheduler_output)  # also if that failed: the snapshot applies once
        if scheduler_output.is_empty():
            return None
        batch = self.make_batch(scheduler_output, previous)
        hidden_states, inputs = self.forward(batch, scheduler_output)
        if self.spec is not None and self.spec.follows_steps:
            self.spec.follow(StepTokens(
                scheduler_output.request_ids, inputs.input_ids, inputs.positions, hidden_states,
                np.asarray(inputs.query_start, dtype=np.int64),
                np.asarray(scheduler_output.num_computed_tokens, dtype=np.int64),
                inputs.attention_metadata(self.attention_backend), self._draft_kv(batch.rows)))
        if self.stage is not None and not self.stage.is_last:
            return None  # the last stage samples
        prompt_logprobs = self._prompt_logprobs(batch, hidden_states, inputs) if self.prompt_logprob_ids else None
        pooled = (self.pooler.pool(hidden_states, batch, inputs.query_start, scheduler_output.pooling_rows)
                  if self.pooler is not None else None)
        if not batch.sampling_requests:
            if not prompt_logprobs and not pooled:
                return None
            # Nothing sampled, but the engine must read the prompt logprobs or pooled outputs. The next step may
            # take this as its in-flight step: it carries the previous step's tokens (which the
            # engine ignores here, as this step has no sampling rows).
            sampled, request_ids = ((previous.sampled, previous.request_ids) if previous is not None
                                    else (torch.empty(0, dtype=torch.long, device=self.device), []))
            return StepOutput(request_ids, SampledTokens(sampled), prompt_logprobs, pooled=pooled)
        # In a decode-only step every row samples: no gather needed.
        gathered = len(batch.sampling_requests) < hidden_states.shape[0]
        if gathered:
            hidden_states = hidden_states[inputs.logits_indices]
        if self.lora is not None:
            self.lora.select_logits_rows(inputs.logits_indices if gathered else None, hidden_states.shape[0])
        logits = self.model.compute_logits(hidden_states).float()
        # The core's penalties and biases come first: the jobs, process_logits and sample see their result.
        adjusted = self.logits_adjuster.apply(logits, batch)
        jobs: list[LogitsJob] = self.hooks.hook.start_logits_job(batch=batch, context=self.hooks.context)
        request_ids = [r.request_id for r in batch.sampling_requests]
        if jobs and previous is not None and not scheduler_output.speculates:
            early_errors: list[Exception] = []
            previous.when_resolved(partial(_tokens_ready, jobs, early_errors))
            running = self._job_thread().submit(_run_jobs, jobs)
            return StepOutput(request_ids, prompt_logprobs=prompt_logprobs, device=self.device, pooled=pooled,
                              deferred=partial(self._sample_after_jobs, running, early_errors, logits, batch, adjusted,
                                               jobs))
        _run_jobs(jobs)
        step = StepOutput(request_ids, self._sample(logits, batch, adjusted, jobs), prompt_logprobs, pooled=pooled)
        if scheduler_output.speculates:
            step.spec = self._verify_and_propose(batch, scheduler_output, step, hidden_states, inputs.query_start,
                                                 logits.shape[1])
        return step

    def _draft_kv(self, rows: np.ndarray) -> DraftKV:
        return DraftKV(self.input_batch, rows, self.block_size, self.attention_backend, self.device)

    def _verify_and_propose(self, batch: Batch, scheduler_output: SchedulerOutput, step: StepOutput,
                            hidden_states: torch.Tensor, query_start: list[int], vocab_size: int) -> SpecDecodeOutput:
        """A speculating step's outcome: what each sampling request emits (its drafts up to the
        first its rows did not sample, then that row's token: :mod:`hookllm.spec.verify`), and
        the proposer's guesses after those tokens. Reads the step's tokens (waits for the device)."""
        sampling_rows = np.asarray(scheduler_output.sampling_rows, dtype=np.int64)
        requests = [batch.requests[row] for row in scheduler_output.sampling_rows]
        drafts = batch.spec_token_ids or [[] for _ in requests]
        sampled, logprobs = step.resolve()
        token_ids, logprobs_rows, emitted = self.spec.verify(sampled, logprobs, drafts)
        if batch.spec_token_ids is not None:  # else _sample counted the one token each request emits
            self.logits_adjuster.record_emitted(requests, token_ids)
        # The emitted tokens join each request's token row, which the proposer searches.
        rows = batch.rows[sampling_rows]
        self.input_batch.write_token_ids(rows, np.fromiter(map(len, [r.all_token_ids for r in requests]),
                                                           dtype=np.int64, count=len(requests)), token_ids)
        guessing = [i for i, request in enumerate(requests) if takes_drafts(request, self.spec.drafted_extra_args)]
        proposals: list[list[int]] = [[] for _ in requests]
        if guessing:
            index = np.asarray(guessing, dtype=np.int64)
            history, lengths = self.input_batch.token_rows(rows[index])
            # Each request's first verified row among the step's tokens: its last token's, before its drafts.
            last_tokens = np.asarray(query_start, dtype=np.int64)[sampling_rows + 1] - 1
            token_index = last_tokens - num_verified_rows(drafts) + 1
            guesses = self.spec.propose(ProposalBatch(
                [requests[i] for i in guessing], history, lengths, self.spec.config.num_speculative_tokens,
                hidden_states, verified_row_starts(drafts)[index], emitted[index], self._draft_kv(rows[index]),
                token_index[index]), vocab_size)
            for i, guess in zip(guessing, guesses):
                proposals[i] = guess
        return SpecDecodeOutput(token_ids, logprobs_rows, proposals)

    def _job_thread(self) -> ThreadPoolExecutor:
        """The one background thread that runs logits jobs, made for the first deferred step."""
        if self.job_thread is None:
            self.job_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hookllm-logits-jobs")
        return self.job_thread

    @torch.inference_mode()
    def _sample_after_jobs(self, running: Future[None], early_errors: list[Exception], logits: torch.Tensor,
                           batch: Batch, adjusted: AdjustedRows | None, jobs: list[LogitsJob]) -> SampledTokens:
        """A deferred step's sampling, when the step is finished: its jobs ran in the background
        thread from its launch (and ``tokens_ready`` when the previous step's tokens were read),
        while the main thread processed the previous step's outputs and scheduled the next; this
        waits for them, then samples as an inline step does. Nothing the hooks read changed in
        between, so the tokens are the same."""
        running.result()
        if early_errors:
            raise early_errors[0]
        return self._sample(logits, batch, adjusted, jobs)

    def _sample(self, logits: torch.Tensor, batch: Batch, adjusted: AdjustedRows | None,
                jobs: list[LogitsJob]) -> SampledTokens:
        """Apply the jobs (already run), then ``process_logits`` and ``sample``."""
        for job in jobs:
            job.apply(logits)
        self.hooks.hook.process_logits(logits=logits, batch=batch, context=self.hooks.context)
        sampled = self.hooks.hook.sample(logits=logits, batch=batch, context=self.hooks.context)
        self._check_sampled(sampled, logits.shape[0])
        if batch.spec_token_ids is None:  # a speculating step counts the tokens it keeps (record_emitted)
            self.logits_adjuster.record_sampled(adjusted, sampled)
        return self._sampled_tokens(logits, batch, sampled)

    def shutdown(self) -> None:
        """Stop the logits-job thread, if any, once its job is done; then the plugins' own (``worker_shutdown``)."""
        if self.job_thread is not None:
            self.job_thread.shutdown()
        self.hooks.hook.worker_shutdown(model=self.model, context=self.hooks.context)

    def _prompt_logprobs(self, batch: Batch, hidden_states: torch.Tensor, inputs: ModelInputs
                         ) -> dict[str, tuple[torch.Tensor, ...]]:
        """For requests asking prompt logprobs: each chunk position's logprob of the next prompt
        token, its rank and the top k, from the model's raw logits (one pass for all of them)."""
        spans = []  # (request, its first row in the step's hidden states, first and end positions)
        for i, request in enumerate(batch.requests):
            reported = self.prompt_logprob_ids.get(request.request_id)
            if reported is None:
                continue
            computed, count = request.num_computed_tokens, batch.num_scheduled_tokens[i]
            start, end = max(computed, reported), min(computed + count, request.num_prompt_tokens - 1)
            if computed + count >= request.num_prompt_tokens:
                del self.prompt_logprob_ids[request.request_id]  # its last prompt chunk
            else:
                self.prompt_logprob_ids[request.request_id] = max(reported, end)
            if end > start:
                spans.append((request, inputs.query_start[i] + start - computed, start, end))
        if not spans:
            return {}
        rows = np.concatenate([np.arange(row, row + end - start) for _, row, start, end in spans])
        targets = np.concatenate([request.prompt_token_ids[start + 1:end + 1] for request, _, start, end in spans])
        # Targets first: the logprobs kernel's pointer stays 16-byte aligned (Triton compiles a variant per alignment).
        targets_t, rows_t = to_device_async(torch.from_numpy(np.stack([targets, rows])), hidden_states.device)
        if self.lora is not None:
            self.lora.select_logits_rows(rows_t, len(rows))
        logits = self.model.compute_logits(hidden_states[rows_t])
        num_top = max(request.sampling_params.prompt_logprobs for request, *_ in spans)
        logprob, rank, top_values, top_ids = ops_for(logits).token_logprobs(logits, targets_t, num_top)
        result, first = {}, 0
        for request, _, start, end in spans:
            part, n = slice(first, first + end - start), request.sampling_params.prompt_logprobs
            result[request.request_id] = (targets_t[part], logprob[part], rank[part], top_values[part, :n],
                                          top_ids[part, :n])
            first = part.stop
        return result

    def _check_sampled(self, sampled: object, num_rows: int) -> None:
        if not isinstance(sampled, torch.Tensor) or sampled.dtype != torch.long or sampled.shape != (num_rows,):
            got = (f"tensor of dtype {sampled.dtype} and shape {tuple(sampled.shape)}"
                   if isinstance(sampled, torch.Tensor) else type(sampled).__name__)
            raise SamplerContractError(
                f"{self.hooks.overriding_plugins('sample')}: the sample hook must return a 1-D torch.long tensor of "
                f"{num_rows} token ids (one per logits row), got {got}"
            )

    @staticmethod
    def _sampled_tokens(logits: torch.Tensor, batch: Batch, sampled: torch.Tensor) -> SampledTokens:
        """The sampled tokens plus, where asked, their logprobs and the top-n from the processed logits."""
        wanted = [r.sampling_params.logprobs for r in batch.sampling_requests]
        if all(n is None for n in wanted):
            return SampledTokens(sampled)
        num_top = max(n for n in wanted if n is not None)
        return SampledTokens(sampled, ops_for(logits).token_logprobs(logits, sampled, num_top), wanted)


def _tokens_ready(jobs: list[LogitsJob], errors: list[Exception]) -> None:
    """The previous step's tokens are on the host: jobs that can start their work now do; an
    error waits for the deferred step's sampling (the previous step is not the one that failed)."""
    for job in jobs:
        ready = getattr(job, "tokens_ready", None)
        if ready is not None:
            try:
                ready()
            except Exception as exc:  # noqa: BLE001 - raised by the step whose job it is
                errors.append(exc)


@torch.inference_mode()  # in the job thread too: inference mode is per thread
def _run_jobs(jobs: list[LogitsJob]) -> None:
    for job in jobs:
        job.run()
