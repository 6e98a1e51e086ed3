"""Small helpers: vLLM's ``vllm.utils`` names, the engine's host-to-device copy, the GIL's
switch interval for threads that work beside the engine loop, how engine processes start, the
JSON-object options (``--kv-events-config``, ``--speculative-config``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import multiprocessing
import multiprocessing.context
import os
import sys
import time
from typing import Any, Sequence, TypeVar

import torch


_Config = TypeVar("_Config")


def parse_json_config(cls: type[_Config], value: Any, option: str) -> _Config | None:
    """A dataclass of scalar fields from a JSON object (text or dict), as vLLM's JSON options
    take it: None stays None, an instance passes; ``ValueError`` naming ``option`` and what is
    wrong (not JSON, not an object, an unknown key, a value of the wrong type)."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{option} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{option} must be a JSON object, got {type(value).__name__}")
    fields = {field.name: field for field in dataclasses.fields(cls)}
    for key, item in value.items():
        if key not in fields:
            raise ValueError(f"{option} has an unknown key {key!r}; known: {', '.join(fields)}")
        allowed = fields[key].metadata.get("types", (type(fields[key].default),))
        if not isinstance(item, allowed) or (isinstance(item, bool) and bool not in allowed):
            names = " or ".join("null" if kind is type(None) else kind.__name__ for kind in allowed)
            raise ValueError(f"{option}'s {key} must be {names}, got {item!r}")
    return cls(**value)


def to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``, without waiting for the device's queued work.

    On CUDA it is staged in pinned memory and copied non-blocking: a copy from pageable memory
    makes the host wait for the stream, which in the step loop stalls the async overlap.
    """
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


# How the engine starts its processes (the engine process, ranks, data-parallel engines), as
# vLLM's VLLM_WORKER_MULTIPROC_METHOD: "forkserver" (the default where the platform has it) forks
# each from one server process that imported these modules once, so a process starts in a fraction
# of a second instead of importing torch again for several seconds; "spawn" starts a fresh
# interpreter. Never "fork": a parent that has used CUDA or torch's thread pool cannot be forked.
# The server process imports modules only (CUDA is not initialized there), and it inherits the
# environment of the moment it starts: what a child must see, it is given as an argument.
WORKER_MULTIPROC_METHOD_ENV = "HOOKLLM_WORKER_MULTIPROC_METHOD"
# transformers.video_utils: what loading a checkpoint's config imports in transformers 5 (torchvision
# and torch._dynamo with it, several seconds): once in the server, not once per child. A module
# missing from another transformers release is skipped.
PRELOADED_MODULES = ("torch", "transformers", "transformers.video_utils", "hookllm.engine.llm_engine")


def process_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context engine processes start from (see ``WORKER_MULTIPROC_METHOD_ENV``)."""
    default = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    method = os.environ.get(WORKER_MULTIPROC_METHOD_ENV) or default
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{WORKER_MULTIPROC_METHOD_ENV} must be 'forkserver' or 'spawn', got {method!r}")
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(list(PRELOADED_MODULES))  # read when the server first starts
    return context


# With the default 5 ms switch interval a thread that needs the GIL for a moment (to hand over a
# step's outputs) waits whole milliseconds behind a busy thread that holds it. Not for the engine
# loop's own process: there the logits-job thread and the loop traded the GIL so often that
# steps got slower (docs/performance-history.md, "2026-11-30, evening").
GIL_SWITCH_INTERVAL_S = 0.0002


def shorten_gil_switch_interval() -> None:
    """Lower the interpreter's GIL switch interval to ``GIL_SWITCH_INTERVAL_S`` (never raise it).

    Called by whatever starts a thread that must get the GIL back quickly while another thread
    runs Python: the cost is paid only while two threads want it at once.
    """
    sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))


def name_this_process(name: str) -> None:
    """Show this process as ``name`` (at most 15 characters) in ps, top and ``/proc/PID/comm``,
    where a spawned process is otherwise one more "python". Linux only; elsewhere a no-op."""
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:
        pass


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that takes ``--flag_name`` as well as ``--flag-name``.

    Underscores in a long option's name (before any ``=value``) become dashes before parsing,
    so scripts written either way work; values and positional arguments are left alone.
    """

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        args = list(sys.argv[1:] if args is None else args)
        end = args.index("--") if "--" in args else len(args)  # after "--" everything is positional
        return super().parse_known_args([_dashed(arg) for arg in args[:end]] + args[end:], namespace)


def _dashed(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value


def join_or_kill(process: Any, deadline: float) -> bool:
    """Wait for ``process`` (a ``multiprocessing.Process``) until ``deadline`` (``time.monotonic()``),
    then kill it if it is still running, saying which. True if it ended on its own with status 0."""
    process.join(max(0.0, deadline - time.monotonic()))
    if not process.is_alive():
        return process.exitcode == 0
    logging.getLogger(__name__).warning("%s (pid %d) did not stop in time; killing it", process.name, process.pid)
    process.kill()
    process.join(10.0)  # a killed process ends at once: this only bounds the wait for it
    return False
