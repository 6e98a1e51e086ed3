"""The worker's adapters: ``max_loras`` device slots, filled on demand, and each step's mapping.

A step's adapters are at most ``max_loras`` (the scheduler admits a request only when its adapter
has or can get a slot), so each finds a slot: the one it holds, a free one, or the least recently
used slot no row of the step needs, overwritten. Its weights come from the host cache of
``max_cpu_loras`` adapters (least recently used out), else from its folder. Slot writes are
queued on the device's stream after the step in flight, which may still read the old adapter.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import nn

from hookllm.distributed import get_pp_size
from hookllm.lora.adapter import LoRAAdapter, load_adapter, target_shapes
from hookllm.lora.layers import LoRAMapping, parallel_projections, wrap_projections
from hookllm.lora.request import LoRARequest
from hookllm.plugins.contract import SupportsLoRA


class LoRAManager:
    def __init__(self, model: nn.Module, hf_config: Any, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 max_tokens: int, device: torch.device, dtype: torch.dtype, kernels: ModuleType):
        self.hf_config = hf_config
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.dtype = dtype
        self.mapping = LoRAMapping(max_loras, max_tokens, device)
        projections = model.lora_projections() if isinstance(model, SupportsLoRA) else parallel_projections(model)
        self.targets = wrap_projections(projections, max_loras, max_lora_rank, self.mapping, kernels, dtype)
        if not any(".layers." in name for name in self.targets):
            raise ValueError(f"enable_lora: {type(model).__name__} has no projections hookllm can adapt (the "
                             "Llama-family decoders' q/k/v, o, gate/up and down, natively or through transformers)")
        _check_every_target_wrapped(model, hf_config, self.targets)
        # Each wrapper's PEFT module names, one per slice in order.
        self.wrappers: dict[nn.Module, list[str]] = {}
        for name, (wrapper, _) in self.targets.items():
            self.wrappers.setdefault(wrapper, []).append(name)
        self.adapters: dict[int, LoRARequest] = {}  # every adapter the runner's requests named, by id
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.free_slots = list(range(max_loras - 1, -1, -1))
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # adapter id -> weights, least recently used first
        self._grouping_length = 0  # of the last step's mapping: the slots' starts and counts and the token order

    def add_adapter(self, lora_request: LoRARequest) -> None:
        """Remember a new request's adapter, for the step that first needs it in a slot."""
        self.adapters[lora_request.lora_int_id] = lora_request

    def prepare_step(self, row_adapters: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Give every adapter of the step's rows (``row_adapters``: each row's adapter id from the
        persistent batch, -1 for none) a slot, and return the step's mapping for the device, flat
        int64: each slot's start and count, then the token order (laid out as
        :class:`LoRAMapping`'s buffer), then each token's slot (empty when no row has an adapter:
        the step skips the kernels)."""
        adapted_rows = row_adapters >= 0
        self.mapping.active = bool(adapted_rows.any())
        self.mapping.logits_row_slots = None  # named again before each LM head call
        if not self.mapping.active:
            return np.zeros(0, dtype=np.int64)
        ids = np.unique(row_adapters[adapted_rows])
        row_slots = np.full(len(row_adapters), -1, dtype=np.int64)
        row_slots[adapted_rows] = self._slots_for(ids.tolist())[np.searchsorted(ids, row_adapters[adapted_rows])]
        token_slots = np.repeat(row_slots, counts)
        adapted = np.flatnonzero(token_slots >= 0)
        order = adapted[np.argsort(token_slots[adapted], kind="stable")]
        slot_counts = np.bincount(token_slots[adapted], minlength=self.max_loras)
        padding = np.zeros(self.mapping.order_offset - 2 * self.max_loras, dtype=np.int64)
        self._grouping_length = self.mapping.order_offset + len(order)
        return np.concatenate([np.cumsum(slot_counts) - slot_counts, slot_counts, padding, order, token_slots])

    def apply_step(self, mapping: torch.Tensor) -> None:
        """Copy ``prepare_step``'s mapping, now on the device, into the buffers the layers read."""
        if mapping.shape[0]:
            grouping = self._grouping_length
            self.mapping.buffer[:grouping].copy_(mapping[:grouping])
            self.mapping.token_slots[:mapping.shape[0] - grouping].copy_(mapping[grouping:])

    def select_logits_rows(self, token_indices: torch.Tensor | None, count: int) -> None:
        """Before the LM head runs on the step's tokens ``token_indices`` (None: its first ``count``)."""
        if self.mapping.active:
            self.mapping.select_logits_rows(token_indices, count)

    def _slots_for(self, lora_ids: list[int]) -> np.ndarray:
        """The slot of each of a step's adapters, loading those that hold none."""
        if len(lora_ids) > self.max_loras:
            raise RuntimeError(f"a step has {len(lora_ids)} LoRA adapters, over max_loras {self.max_loras}")
        for lora_id in lora_ids:
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
            else:
                self._load(self.adapters[lora_id], lora_ids)
        return np.asarray([self.slot_of[lora_id] for lora_id in lora_ids], dtype=np.int64)

    def _load(self, request: LoRARequest, needed: list[int]) -> None:
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next(lora_id for lora_id in self.slot_of if lora_id not in needed)
            slot = self.slot_of.pop(victim)
        adapter = self._host_adapter(request)
        for wrapper, names in self.wrappers.items():
            wrapper.set_slot(slot, [adapter.weights.get(name) for name in names])
        self.slot_of[request.lora_int_id] = slot

    def _host_adapter(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self.host.get(request.lora_int_id)
        if adapter is None:
            adapter = load_adapter(request, self.hf_config, self.max_lora_rank, self.dtype, served_names=None)
            self.host[request.lora_int_id] = adapter
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)
        self.host.move_to_end(request.lora_int_id)
        return adapter


def _check_every_target_wrapped(model: nn.Module, hf_config: Any, targets: dict[str, Any]) -> None:
    """Adapters are checked against the config's projections (:func:`target_shapes`): each of
    those in the model's layers (a pipeline stage's) must be wrapped, or an adapter's weights for
    it would be dropped unseen."""
    def layer(name: str) -> str | None:
        match = re.search(r"\.layers\.(\d+)\.", name)
        return match and match.group(1)

    present = {layer(name) for name in targets if layer(name) is not None}
    # Under pipeline parallelism a stage has the embedding or the head, or neither.
    vocab_modules_here = get_pp_size() == 1
    missing = [name for name in target_shapes(hf_config) if name not in targets
               and (layer(name) in present if layer(name) is not None else vocab_modules_here)]
    if missing:
        raise ValueError(f"enable_lora: {type(model).__name__} has no adaptable projection for "
                         f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
