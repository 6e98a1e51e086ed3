"""The core's encoder scheduling and cache (hookllm.multimodal.encoder_cache), without a model."""

import random

import torch

from hookllm.multimodal.encoder_cache import EncoderCache, scheduled_slices
from hookllm.sampling_params import SamplingParams
from hookllm.sched.request import MultiModalItem
from hookllm.worker.batch import CachedRequestState


def state(request_id, num_tokens, items, computed=0):
    return CachedRequestState(request_id, list(range(num_tokens)), num_tokens, SamplingParams(), items, computed)


def test_scheduled_slices_cover_exactly_the_item_rows_of_each_chunk():
    rng = random.Random(0)
    requests, counts = [], []
    for i in range(6):
        items = [MultiModalItem("image", 2, 5, "a"), MultiModalItem("image", 9, 4, f"b{i}")]
        computed = rng.randrange(0, 14)
        requests.append(state(f"r{i}", 16, items, computed))
        counts.append(rng.randrange(1, 17 - computed))
    query_start = [sum(counts[:i]) for i in range(len(counts))]
    # Independently: every flat row whose position falls inside an item, and which row of the item it is.
    expected = {}
    for request, count, start in zip(requests, counts, query_start):
        for k in range(count):
            position = request.num_computed_tokens + k
            for item in request.mm_items:
                if item.offset <= position < item.offset + item.length:
                    expected[start + k] = (request.request_id, item.content_hash, position - item.offset)
    got = {}
    for s in scheduled_slices(requests, counts, query_start):
        for k in range(s.last - s.first):
            got[s.row + k] = (s.request_id, s.item.content_hash, s.first + k)
    assert got == expected


def test_a_shared_entry_is_dropped_with_its_last_user():
    cache = EncoderCache()
    item = MultiModalItem("image", 0, 2, "h")
    first, second = state("first", 4, [item]), state("second", 4, [item])
    cache.add("h", torch.zeros(2, 3))
    cache.use("h", "first")
    cache.use("h", "second")
    cache.release(first)
    assert "h" in cache
    cache.release(second)
    assert len(cache) == 0
