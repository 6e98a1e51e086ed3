"""Turns a SchedulerOutput into flat model inputs, runs the model, and samples.

The per-step path: build inputs on the host in bulk (numpy), copy them once, let plugins adjust
them (``prepare_inputs``), run the model under the attention metadata, compute logits only for
rows that sample, then ``process_logits`` and ``sample``. The sampled token ids are the one
value read back from the device each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
from torch import nn

from hookllm.cuda_graph import CudaGraphRunner
from hookllm.forward_context import AttentionMetadata, set_forward_context
from hookllm.plugins.manager import ActiveHooks
from hookllm.scheduler import SchedulerOutput


@dataclass
class ModelInputs:
    """The flat batch of one step; ``prepare_inputs`` hooks may change it in place."""

    input_ids: torch.Tensor  # [num_tokens] long
    positions: torch.Tensor  # [num_tokens] long
    slot_mapping: torch.Tensor  # [num_tokens] long
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    logits_indices: torch.Tensor  # [num_sampling_rows] long: rows whose hidden state is sampled
    query_start: list[int]  # host copy of query_start_loc, for hooks
    max_query_len: int
    max_seq_len: int
    inputs_embeds: torch.Tensor | None = None  # [num_tokens, hidden]: replaces input_ids if set


class StepOutput:
    """A launched step's sampled token ids (and logprobs): copied to the host without waiting,
    read by ``resolve``, which waits for the device only if the step is still running."""

    def __init__(self, sampled: torch.Tensor, logprobs: tuple[torch.Tensor, ...] | None = None,
                 wanted: list[int | None] | None = None):
        self._sampled = sampled.to("cpu", non_blocking=True)
        # (chosen token's logprob, top-n values, top-n ids) and each row's n.
        self._logprobs = tuple(t.to("cpu", non_blocking=True) for t in logprobs) if logprobs else None
        self._wanted = wanted
        self._done = None
        if sampled.is_cuda:
            self._done = torch.cuda.Event()
            self._done.record()

    def resolve(self) -> tuple[list[int], list[dict[int, float] | None]]:
        """One token id per ``batch.sampling_requests`` and its logprobs entry (None if not asked)."""
        if self._done is not None:
            self._done.synchronize()
        token_ids = self._sampled.tolist()
        if self._logprobs is None:
            return token_ids, [None] * len(token_ids)
        chosen, top_values, top_ids = (t.tolist() for t in self._logprobs)
        entries: list[dict[int, float] | None] = []
        for row, n in enumerate(self._wanted):
            if n is None:
                entries.append(None)
                continue
            entry = dict(zip(top_ids[row][:n], top_values[row][:n]))
            entry[token_ids[row]] = chosen[row]
            entries.append(entry)
        return token_ids, entries


class SamplerContractError(RuntimeError):
    pass


def _plugins_phrase(plugins: list[str]) -> str:
    """Who broke a firstresult hook's contract: the one overriding plugin, or the candidates."""
    if len(plugins) == 1:
        return f"plugin {plugins[0]!r}"
    return "one of the plugins " + ", ".join(repr(p) for p in plugins)


class ModelRunner:
    def __init__(self, model: nn.Module, hooks: ActiveHooks, device: torch.device, block_size: int,
                 attention_backend: ModuleType):
        self.model = model
        self.hooks = hooks
        self.device = device
        self.block_size = block_size
        self.attention_backend = attention_backend
        self.cuda_graphs: CudaGraphRunner | None = None  # set by the worker unless enforce_eager
        self.last_sampled = torch.empty(0, dtype=torch.long, device=device)
        self.last_sampled_rows: dict[str, int] = {}

    def build_inputs(self, batch: SchedulerOutput) -> ModelInputs:
        requests, counts_list = batch.requests, batch.num_scheduled_tokens
        starts_list = [r.num_computed_tokens for r in requests]
        token_ids: list[int] = []
        # Rows whose token was sampled by the step still on the device: copied there from its output.
        pending_rows: list[int] = []
        pending_sources: list[int] = []
        for request, start, count in zip(requests, starts_list, counts_list):
            known = request.all_token_ids[start:start + count]
            token_ids += known
            if len(known) < count:
                pending_rows.append(len(token_ids))
                pending_sources.append(self.last_sampled_rows[request.request_id])
                token_ids.append(0)
        counts = np.asarray(counts_list, dtype=np.int64)
        starts = np.asarray(starts_list, dtype=np.int64)
        num_seqs, num_tokens = len(counts_list), len(token_ids)
        query_start = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start[1:])
        seq_lens = starts + counts
        # positions: for each request, start .. start + count - 1, laid out flat.
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_start[:-1] - starts, counts)
        block_tables = batch.block_tables
        max_blocks = block_tables.shape[1]
        token_rows = np.repeat(np.arange(num_seqs), counts)
        slot_mapping = block_tables[token_rows, positions // self.block_size] * self.block_size + positions % self.block_size
        logits_rows = np.flatnonzero(seq_lens == np.asarray([r.num_tokens for r in requests]))
        logits_indices = query_start[1:][logits_rows] - 1
        # One host->device copy for the whole step (pinned, asynchronous on CUDA).
        parts = [np.asarray(token_ids, dtype=np.int64), positions, slot_mapping, logits_indices,
                 seq_lens, query_start, block_tables.ravel(), np.asarray(pending_rows + pending_sources, dtype=np.int64)]
        host = torch.from_numpy(np.concatenate(parts))
        if self.device.type == "cuda":
            host = host.pin_memory()
        flat = host.to(self.device, non_blocking=True)
        input_ids, positions_t, slots_t, logits_t, seq_lens_t, query_start_t, tables_t, pending = flat.split(
            [len(part) for part in parts])
        if pending_rows:
            input_ids[pending[:len(pending_rows)]] = self.last_sampled[pending[len(pending_rows):]]
        return ModelInputs(
            input_ids=input_ids,
            positions=positions_t,
            slot_mapping=slots_t,
            block_tables=tables_t.view(num_seqs, max_blocks).to(torch.int32),
            seq_lens=seq_lens_t.to(torch.int32),
            query_start_loc=query_start_t.to(torch.int32),
            logits_indices=logits_t,
            query_start=query_start.tolist(),
            max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()),
        )

    @torch.inference_mode()
    def forward(self, batch: SchedulerOutput) -> tuple[torch.Tensor, ModelInputs]:
        """Build the inputs, let plugins adjust them, run the model: hidden states of every row."""
        inputs = self.build_inputs(batch)
        self.hooks.hook.prepare_inputs(batch=batch, inputs=inputs, model=self.model)
        graphs = self.cuda_graphs
        if (graphs is not None and inputs.inputs_embeds is None
                and graphs.can_run(len(batch.requests), inputs.max_query_len, inputs.block_tables.shape[1])):
            hidden_states = graphs.run(inputs.input_ids, inputs.positions, inputs.slot_mapping,
                                       inputs.block_tables, inputs.seq_lens)
            return hidden_states, inputs
        metadata = AttentionMetadata(
            slot_mapping=inputs.slot_mapping, block_tables=inputs.block_tables, seq_lens=inputs.seq_lens,
            query_start_loc=inputs.query_start_loc, max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len, backend=self.attention_backend,
        )
        with set_forward_context(metadata):
            hidden_states = self.model(inputs.input_ids, inputs.positions, inputs.inputs_embeds)
        return hidden_states, inputs

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> StepOutput:
        hidden_states, inputs = self.forward(batch)
        if not batch.sampling_requests:
            return StepOutput(torch.empty(0, dtype=torch.long))
        # In a decode-only step every row samples: no gather needed.
        if len(batch.sampling_requests) < hidden_states.shape[0]:
            hidden_states = hidden_states[inputs.logits_indices]
        logits = self.model.compute_logits(hidden_states).float()
        self.hooks.hook.process_logits(logits=logits, batch=batch)
        sampled = self.hooks.hook.sample(logits=logits, batch=batch)
        self._check_sampled(sampled, self.hooks.overriding_plugins("sample"), logits.shape[0])
        # The next step reads these rows on the device for requests whose token is not known yet.
        self.last_sampled = sampled
        self.last_sampled_rows = {r.request_id: row for row, r in enumerate(batch.sampling_requests)}
        return self._step_output(logits, batch, sampled)

    @staticmethod
    def _check_sampled(sampled: object, plugins: list[str], num_rows: int) -> None:
        if not isinstance(sampled, torch.Tensor) or sampled.dtype != torch.long or sampled.shape != (num_rows,):
            got = (f"tensor of dtype {sampled.dtype} and shape {tuple(sampled.shape)}"
                   if isinstance(sampled, torch.Tensor) else type(sampled).__name__)
            raise SamplerContractError(
                f"{_plugins_phrase(plugins)}: the sample hook must return a 1-D torch.long tensor of "
                f"{num_rows} token ids (one per logits row), got {got}"
            )

    @staticmethod
    def _step_output(logits: torch.Tensor, batch: SchedulerOutput, sampled: torch.Tensor) -> StepOutput:
        """The sampled tokens plus, where asked, their logprobs and the top-n from the processed logits."""
        wanted = [r.sampling_params.logprobs for r in batch.sampling_requests]
        if all(n is None for n in wanted):
            return StepOutput(sampled)
        logprobs = logits.log_softmax(dim=-1)
        top_values, top_ids = logprobs.topk(max(n for n in wanted if n is not None), dim=-1)
        chosen = logprobs.gather(1, sampled[:, None]).squeeze(1)
        return StepOutput(sampled, (chosen, top_values, top_ids), wanted)
