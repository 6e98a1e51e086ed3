"""KV-cache events in vLLM's wire format, for prefix-aware routers (``--kv-events-config``).

A router that knows which prompt prefixes each engine holds sends a request where its prefix is
cached. vLLM publishes that knowledge as events over a ZeroMQ PUB socket; hookllm publishes the
same messages, so a router built for vLLM (llm-d, Dynamo, vllm-router) reads hookllm's.

Each message is three frames: the topic (UTF-8), a sequence number (8 bytes, big-endian,
counting from 0, one per batch: a gap tells a subscriber it missed a batch), and a
:class:`KVEventBatch` encoded with msgpack. The structs are vLLM's (``vllm/distributed/
kv_events.py``) field for field, in its order, encoded as vLLM 0.22-0.23 do: positional arrays
(``array_like``: every field, defaults included), an event's first element its class name
(``tag``). (vLLM later moved the events themselves to maps keyed by field name; routers read
both, and every router reads the arrays.)

What hookllm fills, and how:

- ``block_hashes``: the block's SHA-256 content digest (32 bytes), the key of hookllm's prefix
  cache (``BlockManager.block_hashes``). vLLM sends ints or bytes (``ExternalBlockHash``): to a
  router a hash is opaque, equal content having an equal hash. One block per event.
- ``parent_block_hash``: the previous block's digest; None for a prompt's first block (its
  digest chains the request's ``cache_salt`` instead), as in vLLM.
- ``token_ids``: the block's ``block_size`` token ids. ``block_size``: the engine's.
- ``lora_id``, ``lora_name``: the request's LoRA adapter's ``lora_int_id`` and name (None without
  one); its first block's digest chains the adapter too. ``medium``: ``"GPU"``, vLLM's name
  for the engine's own KV cache, on a CPU device too.
- ``extra_keys``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``: None.
  ``group_idx``: the KV cache group (``hookllm.worker.kv_cache_groups``; 0 for a model whose
  layers share one window): a model with sliding-window layers caches each block once per group.
- ``BlockRemoved``: the digest of a cached block evicted for new tokens (a block freed by its
  request stays cached until then), with its ``medium`` and ``group_idx``.
- ``AllBlocksCleared``: the prefix cache was reset (``LLM.reset_prefix_cache()``).
- ``KVEventBatch``: ``ts`` the time of publishing (``time.time()``), ``events`` one step's in
  the order they happened, ``data_parallel_rank`` the engine's rank (hookllm runs one: 0).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Union

import msgspec

from hookllm.lora.request import LoRARequest
from hookllm.utils import parse_json_config

# vLLM's ExternalBlockHash: a hash as bytes (hookllm's SHA-256 digests) or an int.
BlockHash = Union[bytes, int]
MEDIUM_GPU = "GPU"  # vLLM's name for the engine's KV cache (its other media are offloading tiers)
PUBLISHERS = ("zmq", "null")


class KVCacheEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    """One change to the prefix cache (the tag, the class name, is the array's first element)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: int | None = None


def block_stored(block_hash: bytes, parent_hash: bytes | None, token_ids: list[int], block_size: int,
                 group: int, lora_request: LoRARequest | None = None) -> BlockStored:
    """The event of one block entering the prefix cache (of a request with ``lora_request``'s adapter)."""
    lora_id, lora_name = (None, None) if lora_request is None else (lora_request.lora_int_id, lora_request.lora_name)
    return BlockStored([block_hash], parent_hash, token_ids, block_size, lora_id=lora_id, medium=MEDIUM_GPU,
                       lora_name=lora_name, group_idx=group)


def block_removed(block_hash: bytes, group: int) -> BlockRemoved:
    """The event of one cached block evicted (its hash forgotten, the block reused)."""
    return BlockRemoved([block_hash], MEDIUM_GPU, group_idx=group)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` keys that hookllm reads (vLLM's replay socket is not offered)."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"  # "null": record and drop (what the events cost, without a socket)
    endpoint: str = "tcp://*:5557"  # where the PUB socket binds
    topic: str = ""

    @classmethod
    def parse(cls, value: "KVEventsConfig | str | dict | None") -> "KVEventsConfig | None":
        """A config from a JSON object (text or dict); ValueError naming what is wrong."""
        config = parse_json_config(cls, value, "kv_events_config")
        if config is None:
            return None
        if config.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config has an unknown publisher {config.publisher!r}; "
                             f"use {' or '.join(PUBLISHERS)}")
        return config


class KVEventPublisher:
    """Sends each step's events as one :class:`KVEventBatch` on a PUB socket bound to the config's
    endpoint; the "null" publisher drops them.

    It sends from the engine's thread: a PUB socket never blocks (a subscriber that falls
    behind by the high-water mark loses batches, and sees the gap in the sequence numbers), and
    encoding a step's few events costs microseconds, so no thread or queue is needed.
    """

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        self.topic = config.topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self.next_seq = 0
        self.encoder = msgspec.msgpack.Encoder()
        self.context: Any = None  # zmq's context and PUB socket: imported only when events are published
        self.socket: Any = None
        if config.publisher == "zmq":
            import zmq

            self.context = zmq.Context()
            self.socket = self.context.socket(zmq.PUB)
            try:
                self.socket.bind(config.endpoint)
            except zmq.ZMQError as error:
                self.shutdown()
                raise ValueError(f"kv_events_config's endpoint {config.endpoint!r} cannot be bound: {error}") from None

    def publish(self, events: list[KVCacheEvent]) -> None:
        if self.socket is None:
            return
        batch = KVEventBatch(time.time(), events, self.data_parallel_rank)
        self.socket.send_multipart([self.topic, self.next_seq.to_bytes(8, "big"), self.encoder.encode(batch)])
        self.next_seq += 1

    def shutdown(self) -> None:
        """Close the socket (batches not yet sent are dropped: no subscriber waits on them)."""
        if self.socket is not None:
            self.socket.close(linger=0)
            self.socket = None
        if self.context is not None:
            self.context.term()
            self.context = None
