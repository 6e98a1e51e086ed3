"""``AsyncLLM``: an asyncio front for the synchronous ``LLMEngine``.

One thread owns the engine: it runs the commands other threads queue (add, abort, tokenize,
render a chat) between steps and steps the engine while any request is unfinished; idle, it
blocks on the command queue. Outputs reach each request's ``asyncio.Queue`` through
``loop.call_soon_threadsafe``. Only that thread ever touches the engine, so the engine needs no
locks; the one exception is decoding token ids, which only reads the tokenizer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import sys
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, TypeVar

from hookllm.chat import render_chat
from hookllm.config import EngineConfig
from hookllm.engine import LLMEngine
from hookllm.outputs import CompletionOutput, RequestOutput
from hookllm.sampling_params import SamplingParams
from hookllm.scheduler import SchedulerStats

logger = logging.getLogger(__name__)
T = TypeVar("T")
Prompt = str | list[int] | dict[str, Any]


class EngineStepError(RuntimeError):
    """``engine.step()`` raised (e.g. a plugin's hook) while this request was in the engine."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (``shutdown()``); no request can run."""


@dataclass
class _Stream:
    """A request's output queue and what is needed to turn engine outputs into deltas."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is left to tell
            pass


GIL_SWITCH_INTERVAL_S = 0.0002


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for output_queue, output in items:
        output_queue.put_nowait(output)


class AsyncLLM:
    """Async ``generate`` / ``abort`` over one ``LLMEngine`` stepped by a dedicated thread."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._streams: dict[str, _Stream] = {}  # engine thread only
        # Commands for the engine thread: (function, future for its result); None wakes it.
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._stopped = threading.Event()
        self._stats = engine.get_stats()  # replaced (never mutated) by the engine thread
        # The engine thread and the event loop share the GIL: with the default 5 ms switch
        # interval a busy event loop holds the engine thread off for whole milliseconds per step.
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._run, name="hookllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> "AsyncLLM":
        return cls(LLMEngine(config))

    # What the server and plugins may read; all fixed once the engine is built.
    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    @property
    def hooks(self) -> Any:
        return self.engine.hooks

    @property
    def active_plugins(self) -> list[str]:
        return self.engine.active_plugins

    @property
    def is_running(self) -> bool:
        return not self._stopped.is_set()

    def get_stats(self) -> SchedulerStats:
        """Running/waiting requests and KV use as of the last step or command (no waiting on a step)."""
        return self._stats

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps; its exception reaches the caller."""
        return await asyncio.wrap_future(self._submit(lambda: fn(self.engine)))

    def decode(self, token_ids: list[int]) -> str:
        """Token ids to text from any thread: decoding reads the tokenizer and never changes it."""
        return self.engine.tokenizer.decode(token_ids)

    def decode_token(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.call(lambda e: list(e.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]))

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self.call(lambda e: e.tokenizer.decode(token_ids))

    async def render_chat(self, conversation: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        """``hookllm.chat.render_chat`` on the engine thread (the tokenizer is not shared across threads)."""
        return await self.call(lambda e: render_chat(e, conversation, **kwargs))

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs as they come, each holding only the new tokens and text.

        ``ValueError`` from ``add_request`` (bad input) is raised here before anything is yielded.
        Closing or cancelling the iterator before the request finishes aborts it at once.
        """
        request_id = request_id or f"async-{next(self._ids)}"
        # Deltas never take text back: the engine holds back what a stop string may still cut.
        params = dataclasses.replace(params, output_kind="delta")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())

        def add() -> None:
            self.engine.add_request(request_id, prompt, params)
            self._streams[request_id] = stream

        await asyncio.wrap_future(self._submit(add))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (from any thread): its blocks are freed before the next step; its
        consumer, if any, gets a final output with ``finish_reason="abort"``."""
        if self._stopped.is_set():
            return

        def abort() -> None:
            self.engine.abort_request(request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], "abort")], True))

        self._submit(abort)

    def shutdown(self) -> None:
        """Stop the engine thread; requests still running are aborted and their consumers get an error."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._commands.put(None)  # wake the thread if it is waiting for a command
        self._thread.join()

    def _submit(self, fn: Callable[[], T]) -> "concurrent.futures.Future[T]":
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopped.is_set():
            future.set_exception(EngineDeadError("the engine is shut down"))
        else:
            self._commands.put((fn, future))
        return future

    def _run_commands(self, block: bool) -> None:
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return
            block = False
            if command is None:
                continue
            fn, future = command
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - the caller's error, delivered to the caller
                future.set_exception(exc)

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                # Idle: sleep on the queue until a command (or shutdown) arrives; no busy loop.
                self._run_commands(block=not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests() and not self._stopped.is_set():
                    self._step()
                self._stats = self.engine.get_stats()
        finally:
            self._close()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a plugin's error fails its requests, not the server
            logger.exception("engine step failed")
            # The engine does not say which requests the failed step held: fail every request it
            # holds now (those running, and any waiting behind them) and free their blocks, as
            # LLM.generate does; requests added afterwards run normally.
            failed = [rid for rid in self._streams if self.engine.has_request(rid)]
            self.engine.abort_request(failed)
            error = EngineStepError(f"the engine step failed: {type(exc).__name__}: {exc}")
            for rid in failed:
                self._streams.pop(rid).put(error)
            return
        # One wake-up per event loop per step (not one per request): a step may hold hundreds.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            batches.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: nobody is left to tell
                pass

    def _close(self) -> None:
        """On the engine thread, at the end: abort what runs, fail waiting consumers and commands."""
        self.engine.abort_request(list(self._streams))
        self._stats = self.engine.get_stats()
        error = EngineDeadError("the engine is shut down")
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is not None and command[1].set_running_or_notify_cancel():
                command[1].set_exception(error)
