"""The core's logits stage before any plugin sees the logits: penalties, logit bias, allowed
tokens and bad words, batched on the device.

The model runner owns one :class:`LogitsAdjuster`. A request that uses none of these features
gets no state and costs nothing; while none is live, a step costs one dict check. A request that
uses one gets a slot: rows of device tensors holding its output-token counts (updated from the
sampled tensor itself every step, so the count is exact even while that token is still in
flight under async scheduling), its prompt-token mask, an additive bias row (logit bias, with
``-inf`` outside ``allowed_token_ids`` and on one-token bad words) and its three penalties.

Order (vLLM's): bias and masks first, then repetition, frequency and presence penalties.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from hookllm.kernels import ops_for
from hookllm.worker.batch import Batch, CachedRequestState
from hookllm.utils import to_device_async


@dataclass
class AdjustedRows:
    """Which logits rows were adjusted this step and their slots: ``record_sampled`` counts
    those rows' sampled tokens."""

    rows: torch.Tensor  # [n] long: logits rows
    slots: torch.Tensor  # [n] long: their slots


class LogitsAdjuster:
    def __init__(self, device: torch.device):
        self.device = device
        self.slots: dict[str, int] = {}
        self.free: list[int] = []
        self.pending: dict[str, CachedRequestState] = {}  # added, but the vocabulary width is not known yet
        self.bad_words: dict[str, list[list[int]]] = {}  # multi-token bad words, by request
        self.counts = torch.zeros(0, 0, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(0, 0, dtype=torch.bool, device=device)
        self.bias = torch.zeros(0, 0, dtype=torch.float32, device=device)
        self.penalties = torch.zeros(0, 3, dtype=torch.float32, device=device)  # presence, frequency, repetition
        # The last step's sampling requests and their AdjustedRows (reset when a slot changes).
        self.last_rows: tuple[list[CachedRequestState], AdjustedRows | None] = ([], None)

    def add(self, request: CachedRequestState) -> None:
        """Take a new request if it uses any of this stage's features."""
        if request.sampling_params.needs_logits_processing:
            self.pending[request.request_id] = request

    def remove(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        self.bad_words.pop(request_id, None)
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.free.append(slot)
            self.last_rows = ([], None)

    def apply(self, logits: torch.Tensor, batch: Batch) -> AdjustedRows | None:
        """Adjust ``logits`` (``[rows, vocab]``) in place for the rows whose request has a slot."""
        if not self.slots and not self.pending:
            return None
        for request in self.pending.values():
            self._init_slot(request, logits.shape[-1])
        self.pending.clear()
        adjusted = self._adjusted_rows(batch.sampling_requests)
        if adjusted is None:
            return None
        if batch.spec_token_ids is not None and any(batch.spec_token_ids):
            self._apply_with_drafts(logits, adjusted, batch)
        else:
            ops_for(logits).apply_penalties(logits, adjusted.rows, adjusted.slots, self.bias, self.counts,
                                             self.prompt_mask, self.penalties)
        if self.bad_words:
            self._ban_bad_words(logits, batch)
        return adjusted

    def _adjusted_rows(self, requests: list[CachedRequestState]) -> AdjustedRows | None:
        """The rows of ``requests`` that have a slot, and their slots: kept from the last step
        while the rows are the same requests in the same order and no slot changed (most decode
        steps), so a step builds no index."""
        last_requests, last_rows = self.last_rows
        if len(requests) == len(last_requests) and all(map(operator.is_, requests, last_requests)):
            return last_rows
        rows, slots = [], []
        for row, request in enumerate(requests):
            slot = self.slots.get(request.request_id)
            if slot is not None:
                rows.append(row)
                slots.append(slot)
        adjusted = None
        if rows:
            index = to_device_async(torch.tensor(rows + slots, dtype=torch.long), self.device)
            adjusted = AdjustedRows(index[:len(rows)], index[len(rows):])
        self.last_rows = (list(requests), adjusted)
        return adjusted

    def _apply_with_drafts(self, logits: torch.Tensor, adjusted: AdjustedRows, batch: Batch) -> None:
        """A speculating step's rows: each row's counts are its request's plus the drafts before
        it (the tokens its position follows), in a table of the adjusted rows' own."""
        drafts = batch.drafts_before_rows()
        rows = [row for row, request in enumerate(batch.sampling_requests) if request.request_id in self.slots]
        entries = [(i, token) for i, row in enumerate(rows) for token in drafts[row]]
        counts = self.counts[adjusted.slots]
        if entries:
            index = to_device_async(torch.tensor(entries, dtype=torch.long).T.contiguous(), self.device)
            counts.index_put_((index[0], index[1]), torch.ones(len(entries), dtype=counts.dtype, device=self.device),
                              accumulate=True)
        own = torch.arange(len(rows), device=self.device)
        ops_for(logits).apply_penalties(logits, adjusted.rows, own, self.bias[adjusted.slots], counts,
                                         self.prompt_mask[adjusted.slots], self.penalties[adjusted.slots])

    def record_emitted(self, requests: list[CachedRequestState], token_ids: list[list[int]]) -> None:
        """Count a speculating step's emitted tokens (each request's kept drafts and its last
        token), read on the host, for the requests with a slot."""
        entries = [(self.slots[request.request_id], token) for request, tokens in zip(requests, token_ids)
                   if request.request_id in self.slots for token in tokens]
        if entries:
            index = to_device_async(torch.tensor(entries, dtype=torch.long).T.contiguous(), self.device)
            self.counts.index_put_((index[0], index[1]), torch.ones(len(entries), dtype=self.counts.dtype,
                                                                    device=self.device), accumulate=True)

    def record_sampled(self, adjusted: AdjustedRows | None, sampled: torch.Tensor) -> None:
        """Count each adjusted row's sampled token, on the device."""
        if adjusted is not None:
            # A step samples one token per row and a slot has one row: no index repeats, so a
            # plain read-add-write does (index_put_'s accumulate would sort the indices first).
            index = (adjusted.slots, sampled[adjusted.rows])
            self.counts.index_put_(index, self.counts[index] + 1)

    def _init_slot(self, request: CachedRequestState, vocab_size: int) -> None:
        if not self.free:
            self._grow(max(4, 2 * self.counts.shape[0]), vocab_size)
        slot = self.free.pop()
        self.slots[request.request_id] = slot
        self.last_rows = ([], None)
        params = request.sampling_params
        self.counts[slot] = 0  # a request reaches the runner before its first token
        self.prompt_mask[slot] = False
        self.prompt_mask[slot, to_device_async(torch.tensor(request.prompt_token_ids, dtype=torch.long), self.device)] = True
        bias = torch.zeros(vocab_size)
        for token_id, value in (params.logit_bias or {}).items():
            if token_id < vocab_size:
                bias[token_id] = value
        if params.allowed_token_ids is not None:
            allowed = torch.tensor([t for t in params.allowed_token_ids if t < vocab_size], dtype=torch.long)
            bias = torch.full_like(bias, float("-inf")).index_copy_(0, allowed, bias[allowed])
        words = params.bad_words_token_ids or []
        for word in words:
            if len(word) == 1 and word[0] < vocab_size:
                bias[word[0]] = float("-inf")
        longer = [word for word in words if len(word) > 1]
        if longer:
            self.bad_words[request.request_id] = longer
        self.bias[slot] = to_device_async(bias, self.device)
        self.penalties[slot] = to_device_async(torch.tensor([params.presence_penalty, params.frequency_penalty,
                                                             params.repetition_penalty]), self.device)

    def _grow(self, capacity: int, vocab_size: int) -> None:
        """Add slots up to ``capacity`` (every request of an engine shares one vocabulary)."""
        old = self.counts.shape[0]

        def grown(table: torch.Tensor, width: int) -> torch.Tensor:
            extra = torch.zeros(capacity - old, width, dtype=table.dtype, device=self.device)
            return torch.cat([table, extra]) if old else extra

        self.counts, self.prompt_mask = grown(self.counts, vocab_size), grown(self.prompt_mask, vocab_size)
        self.bias, self.penalties = grown(self.bias, vocab_size), grown(self.penalties, 3)
        self.free += range(old, capacity)

    def _ban_bad_words(self, logits: torch.Tensor, batch: Batch) -> None:
        """Ban a bad word's last token where the output ends with the tokens before it."""
        rows, tokens = [], []
        outputs = batch.exact_output_token_ids()  # waits for the in-flight step only
        for row, request in enumerate(batch.sampling_requests):
            for word in self.bad_words.get(request.request_id, ()):
                prefix = word[:-1]
                if outputs[row][-len(prefix):] == prefix and word[-1] < logits.shape[-1]:
                    rows.append(row)
                    tokens.append(word[-1])
        if rows:
            index = to_device_async(torch.tensor([rows, tokens], dtype=torch.long), logits.device)
            logits[index[0], index[1]] = float("-inf")
