"""KV-cache events: a ZeroMQ subscriber, as a prefix-aware router runs one, learns every block
the engine caches, evicts and clears, in vLLM's message format (``hookllm.sched.kv_events``).

The tiny Llama runs on the CPU with 16-token blocks. The expected hashes are worked out from
the digest's documented definition (``BlockManager.block_hashes``), independently of the engine.
"""

from __future__ import annotations

import hashlib
import socket
import struct
import time

import msgspec
import pytest
import zmq

from hookllm import EngineConfig, testing
from hookllm.sched.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

BLOCK = 16
TOPIC = "kv"
RECEIVE_TIMEOUT_MS = 5000
QUIET_MS = 300  # a batch published before generate() returned is in the socket by then


def chained_hashes(token_ids: list[int]) -> list[bytes]:
    """The SHA-256 digests of the full blocks of an unsalted text prompt, by their definition."""
    hashes, parent = [], hashlib.sha256(b"\x00").digest()
    for start in range(0, len(token_ids) - BLOCK + 1, BLOCK):
        block = token_ids[start:start + BLOCK]
        parent = hashlib.sha256(b"\x02" + parent + struct.pack(f"<Q{BLOCK}qQ", BLOCK, *block, 0)).digest()
        hashes.append(parent)
    return hashes


def stored(token_ids: list[int]) -> list[BlockStored]:
    """The BlockStored events of a prompt's full blocks, one per block, each chained to the one before."""
    hashes = chained_hashes(token_ids)
    return [BlockStored([h], hashes[i - 1] if i else None, token_ids[i * BLOCK:(i + 1) * BLOCK], BLOCK,
                        lora_id=None, medium="GPU", lora_name=None, group_idx=0) for i, h in enumerate(hashes)]


@pytest.fixture
def endpoint():
    with socket.socket() as probe:  # a free port (the engine binds it a moment later)
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


@pytest.fixture
def subscriber(endpoint):
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(endpoint)  # connects once the engine's socket is bound
    yield sub
    sub.close(linger=0)
    context.term()


class Received:
    """Every batch the subscriber has taken: (sequence number, raw payload, decoded batch)."""

    def __init__(self, sub: zmq.Socket):
        self.sub = sub
        self.batches: list[tuple[int, bytes, KVEventBatch]] = []
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)

    def take(self, timeout_ms: int) -> bool:
        """Take one batch if one comes within ``timeout_ms``."""
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq, payload = self.sub.recv_multipart()
        assert topic == TOPIC.encode() and len(seq) == 8
        self.batches.append((int.from_bytes(seq, "big"), payload, self.decoder.decode(payload)))
        return True

    def new_events(self) -> list:
        """The events of every batch published since the last call (the first within the timeout)."""
        start = len(self.batches)
        assert self.take(RECEIVE_TIMEOUT_MS), "no KV event batch came"
        while self.take(QUIET_MS):
            pass
        return [event for _, _, batch in self.batches[start:] for event in batch.events]


@pytest.fixture
def events(make_llm, endpoint, subscriber):
    """(an engine publishing to ``subscriber``, what it received); the subscription is live:
    resets (each publishes AllBlocksCleared) until one gets through."""
    made = []

    def make(**kwargs):
        config = {"enable_kv_cache_events": True, "endpoint": endpoint, "topic": TOPIC}
        llm = make_llm(kv_events_config=config, **kwargs)
        made.append(llm)
        received = Received(subscriber)
        deadline = time.monotonic() + 30
        while not received.take(100):
            assert time.monotonic() < deadline, "the subscriber never received a batch"
            assert llm.reset_prefix_cache()
        while received.take(QUIET_MS):
            pass
        return llm, received

    yield make
    for llm in made:
        llm.shutdown()


def prompt(seed: int, length: int) -> list[int]:
    return testing.random_prompts(1, 320, length, length, seed=seed)[0]


def test_each_full_prompt_block_is_stored_with_its_tokens_and_its_parents_hash(events):
    llm, received = events()
    tokens = prompt(1, 3 * BLOCK + 2)  # three full blocks; the last two tokens' block is never cached
    llm.generate({"prompt_token_ids": tokens}, testing.greedy(1))
    assert received.new_events() == stored(tokens)


def test_evicted_blocks_are_removed_least_recently_freed_first(events):
    # Four blocks: A (two full blocks and a partial one) finishes, and its freed blocks stay
    # cached; B needs all four, so it evicts A's full blocks, the last freed first.
    llm, received = events(num_kv_blocks=4)
    a, b = prompt(2, 2 * BLOCK + 8), prompt(3, 3 * BLOCK + 2)
    llm.generate({"prompt_token_ids": a}, testing.greedy(1))
    assert received.new_events() == stored(a)
    llm.generate({"prompt_token_ids": b}, testing.greedy(1))
    a1, a0 = chained_hashes(a)[::-1]
    removed = [BlockRemoved([a1], "GPU", group_idx=0), BlockRemoved([a0], "GPU", group_idx=0)]
    assert received.new_events() == removed + stored(b)


def test_resetting_the_prefix_cache_publishes_all_blocks_cleared(events):
    llm, received = events()
    llm.generate({"prompt_token_ids": prompt(4, 2 * BLOCK)}, testing.greedy(1))
    received.new_events()
    assert llm.reset_prefix_cache()
    assert received.new_events() == [AllBlocksCleared()]


def test_sequence_numbers_count_the_batches(events):
    llm, received = events()
    for seed in range(3):
        llm.generate({"prompt_token_ids": prompt(10 + seed, BLOCK + 1)}, testing.greedy(1))
        received.new_events()
    seqs = [seq for seq, _, _ in received.batches]
    assert len(seqs) >= 4 and seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_the_payload_is_positional_in_vllms_field_order(events):
    llm, received = events()
    tokens = prompt(5, BLOCK)
    llm.generate({"prompt_token_ids": tokens}, testing.greedy(1))
    received.new_events()
    _, payload, batch = received.batches[-1]
    [block_hash] = chained_hashes(tokens)
    # KVEventBatch(ts, events, data_parallel_rank); BlockStored's tag, then block_hashes,
    # parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx,
    # kv_cache_spec_kind, kv_cache_spec_sliding_window.
    assert msgspec.msgpack.decode(payload) == [
        batch.ts, [["BlockStored", [block_hash], None, tokens, BLOCK, None, "GPU", None, None, 0, None, None]], 0]
    assert abs(batch.ts - time.time()) < 60


@pytest.mark.parametrize("value, problem", [
    ("{not json", "not valid JSON"),
    ('["zmq"]', "must be a JSON object"),
    ({"enable_kv_cache_events": True, "replay_endpoint": "tcp://*:5558"}, "unknown key 'replay_endpoint'"),
    ({"enable_kv_cache_events": True, "publisher": "nats"}, "unknown publisher 'nats'"),
    ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events must be bool"),
])
def test_a_bad_kv_events_config_is_a_value_error_naming_the_problem(value, problem):
    with pytest.raises(ValueError, match=problem):
        EngineConfig(model="unused", kv_events_config=value)
