"""The server's LoRA adapters by the name requests give as ``model``: those of ``--lora-modules``
(checked at startup), those loaded at run time (``POST /v1/load_lora_adapter``) and those the
``resolve_lora_adapter`` hook finds for a name nothing else gave.

Every adapter registered gets a ``lora_int_id`` of its own, never given again: the engine keys
an adapter's device slot and its cached KV blocks by the id, so an id reused for other weights
(a name unloaded, then loaded again from a retrained folder) would serve the old adapter's
blocks. ``--lora-modules``' adapters are 1, 2, ... in every API server process alike; the ids of
adapters added later are strided by the process's index among ``--api-server-count`` processes,
so that no two processes give one id to different adapters.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hookllm.lora.adapter import load_adapter
from hookllm.lora.request import LoRARequest

if TYPE_CHECKING:
    from hookllm.engine.async_llm import AsyncLLM

MODULE_KEYS = {"name", "path", "base_model_name"}
# vLLM's switch for its load and unload routes, and hookllm's name for it: either one true turns them on.
RUNTIME_UPDATING_VARIABLES = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "HOOKLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updating_allowed() -> bool:
    """Whether the environment allows loading and unloading adapters at run time (off unless
    asked: a client of those routes makes the server read any folder of its disk)."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true") for name in RUNTIME_UPDATING_VARIABLES)


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` value: the adapter's name, its PEFT folder, and optionally the base
    model it was trained for (vLLM's JSON form)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModulePath:
    """argparse ``type`` of ``--lora-modules``: ``NAME=PATH``, or vLLM's JSON form
    ``{"name": ..., "path": ..., "base_model_name": ...}`` (``base_model_name`` optional)."""
    if not value.lstrip().startswith("{"):
        name, equals, path = value.partition("=")
        if not (equals and name and path):
            raise argparse.ArgumentTypeError(f"{value!r} is neither NAME=PATH nor a JSON object with name and path")
        return LoRAModulePath(name, path)
    try:
        fields = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r} is not valid JSON: {exc}") from None
    if not isinstance(fields, dict) or set(fields) - MODULE_KEYS or not {"name", "path"} <= set(fields):
        raise argparse.ArgumentTypeError(f"{value!r}: a JSON adapter has the keys name and path, and optionally "
                                         "base_model_name")
    fields.setdefault("base_model_name", None)
    if not all(isinstance(fields[key], str) and fields[key] for key in ("name", "path")) or not isinstance(
            fields["base_model_name"], (str, type(None))):
        raise argparse.ArgumentTypeError(f"{value!r}: name and path must be non-empty strings, base_model_name a "
                                         "string")
    return LoRAModulePath(**fields)


class LoRARegistry:
    """name -> ``LoRARequest`` of the adapters a server serves, in the order they came.

    ``model_names``: the names clients give the base model (the first is each adapter's parent
    in ``/v1/models``), which no adapter may take. ``base_names``: every name the base model goes
    by (its path, hub id and served names), one of which an adapter's base model must match.
    ``api_server``: this process's index among the API server processes, and their count.
    """

    def __init__(self, engine: AsyncLLM, model_names: list[str], base_names: list[str],
                 modules: list[LoRAModulePath], api_server: tuple[int, int] = (0, 1)):
        self.engine = engine
        self.model_names = model_names
        self.base_names = base_names
        self._adapters: dict[str, LoRARequest] = {}
        self._resolving: dict[str, asyncio.Future[LoRARequest | None]] = {}
        for lora_int_id, module in enumerate(modules, start=1):
            request = self._request(module.name, module.path, lora_int_id, module.base_model_name)
            self._check(request)
            self._adapters[module.name] = request
        index, count = api_server
        self._ids = itertools.count(len(modules) + 1 + index, count)

    @property
    def enabled(self) -> bool:
        return self.engine.config.enable_lora

    @property
    def parent(self) -> str:
        """The base model's name, as ``/v1/models`` gives it for each adapter."""
        return self.model_names[0]

    def get(self, name: str) -> LoRARequest | None:
        return self._adapters.get(name)

    def adapters(self) -> list[LoRARequest]:
        return list(self._adapters.values())

    async def load(self, name: str, path: str) -> LoRARequest:
        """Check the adapter at ``path`` against the base model (off the event loop: it reads
        the weights) and register it as ``name`` with a new id; ``ValueError`` naming it if the
        name is taken or the adapter does not fit."""
        request = self._request(name, path, next(self._ids))
        await asyncio.to_thread(self._check, request)
        self._check_name(name)  # again: another load of the name may have finished meanwhile
        self._adapters[name] = request
        return request

    def remove(self, name: str) -> LoRARequest | None:
        """Forget the adapter ``name`` (None if unknown). Requests already running keep it; a
        later load of the name gets a new id."""
        self._require_enabled(name)
        return self._adapters.pop(name, None)

    async def resolve(self, name: str) -> LoRARequest | None:
        """The adapter the ``resolve_lora_adapter`` hook finds for ``name``, checked and
        registered; None if no plugin knows it. Concurrent requests for one name share one
        resolution, which a client going away does not cancel for the others."""
        if name not in self._resolving:
            future = self._resolving[name] = asyncio.ensure_future(self._resolve(name))
            future.add_done_callback(lambda _: self._resolving.pop(name, None))
        return await asyncio.shield(self._resolving[name])

    async def _resolve(self, name: str) -> LoRARequest | None:
        hooks = self.engine.hooks
        # On a thread: a resolver may fetch the adapter (from a store synced to local disk, say).
        path = await asyncio.to_thread(hooks.hook.resolve_lora_adapter, lora_name=name, context=hooks.context)
        if path is None:
            return None
        return self._adapters.get(name) or await self.load(name, str(path))

    def _request(self, name: str, path: str, lora_int_id: int, base_model_name: str | None = None) -> LoRARequest:
        self._require_enabled(name)
        self._check_name(name)
        return LoRARequest(name, lora_int_id, os.path.abspath(os.path.expanduser(path)), base_model_name)

    def _require_enabled(self, name: str) -> None:
        if not self.enabled:
            raise ValueError(f"LoRA adapter {name!r}: this server serves no LoRA adapters (start it with "
                             "--enable-lora)")

    def _check_name(self, name: str) -> None:
        if name in self.model_names:
            raise ValueError(f"LoRA adapter {name!r}: the name is the base model's")
        if name in self._adapters:
            raise ValueError(f"The lora adapter {name!r} has already been loaded.")

    def _check(self, request: LoRARequest) -> None:
        """``load_adapter``'s checks (the weights are read, then dropped: the engine loads them
        when a request first needs them)."""
        config = self.engine.config
        load_adapter(request, self.engine.model_config.hf_config, config.max_lora_rank, torch.float32,
                     self.base_names)
