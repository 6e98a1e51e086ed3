"""The model runner's encoder side: each step's item rows, the encoder run once per distinct
item, and its output kept while a live request uses it.

A step needs the rows of an item that fall inside a request's scheduled chunk: under chunked
prefill an item may be cut across steps, and an item whose rows were all taken from the prefix
cache is never needed at all. Items are keyed by content hash, so requests with the same image
share one encoder run and one cache entry; an entry goes when the last request that used it
finishes (or is aborted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from hookllm.plugins.contract import SupportsMultiModal
from hookllm.sched.request import MultiModalItem
from hookllm.worker.batch import CachedRequestState


@dataclass(frozen=True)
class ItemSlice:
    """Rows ``first`` to ``last`` of ``item``'s embeddings, filling a step's flat rows from ``row``."""

    row: int
    request_id: str
    item: MultiModalItem
    first: int
    last: int


def scheduled_slices(requests: Sequence[CachedRequestState], num_scheduled_tokens: Sequence[int],
                     query_start: Sequence[int]) -> list[ItemSlice]:
    """The item rows inside each request's chunk of this step, in flat row order."""
    slices = []
    for request, count, row in zip(requests, num_scheduled_tokens, query_start):
        start, end = request.num_computed_tokens, request.num_computed_tokens + count
        for item in request.mm_items:
            lo, hi = max(start, item.offset), min(end, item.offset + item.length)
            if lo < hi:
                slices.append(ItemSlice(row + lo - start, request.request_id, item, lo - item.offset, hi - item.offset))
    return slices


class EncoderCache:
    """Encoder outputs by content hash, each kept while some live request uses it."""

    def __init__(self) -> None:
        self.embeddings: dict[str, torch.Tensor] = {}
        self.users: dict[str, set[str]] = {}  # request ids, live in this runner

    def __len__(self) -> int:
        return len(self.embeddings)

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self.embeddings

    def add(self, content_hash: str, embeddings: torch.Tensor) -> None:
        self.embeddings[content_hash] = embeddings
        self.users[content_hash] = set()

    def use(self, content_hash: str, request_id: str) -> torch.Tensor:
        """The embeddings, recording ``request_id`` as a user."""
        self.users[content_hash].add(request_id)
        return self.embeddings[content_hash]

    def release(self, request: CachedRequestState) -> None:
        """``request`` is done: drop every entry it was the last user of."""
        for content_hash in {item.content_hash for item in request.mm_items}:
            users = self.users.get(content_hash)
            if users is None:
                continue
            users.discard(request.request_id)
            if not users:
                del self.users[content_hash], self.embeddings[content_hash]


class EncoderRunner:
    """A multimodal model's encoder, as the model runner drives it."""

    def __init__(self, model: SupportsMultiModal) -> None:
        self.model = model
        self.cache = EncoderCache()

    def input_embeddings(self, requests: Sequence[CachedRequestState], num_scheduled_tokens: Sequence[int],
                         query_start: Sequence[int], input_ids: torch.Tensor) -> torch.Tensor | None:
        """The step's input embeddings with its item rows merged in; None when it has no item rows
        (the model then embeds the ids itself)."""
        slices = scheduled_slices(requests, num_scheduled_tokens, query_start)
        if not slices:
            return None
        missing = {s.item.content_hash: s.item for s in slices if s.item.content_hash not in self.cache}
        if missing:
            for content_hash, embeddings in zip(missing, self.model.embed_multimodal(list(missing.values()))):
                self.cache.add(content_hash, embeddings.clone())  # a view would keep the whole batch alive
        rows = torch.cat([torch.arange(s.row, s.row + s.last - s.first) for s in slices]).to(input_ids.device)
        embeddings = torch.cat([self.cache.use(s.item.content_hash, s.request_id)[s.first:s.last] for s in slices])
        return self.model.merge_multimodal_embeddings(self.model.embed_tokens(input_ids), rows, embeddings)

    def release(self, request: CachedRequestState) -> None:
        if request.mm_items:
            self.cache.release(request)
