"""``AsyncLLM``: an asyncio front for the engine loop (``hookllm.engine.core_client``).

The engine steps in a process of its own (``AsyncLLM(config=...)``, the server's way), in
``data_parallel_size`` processes (``hookllm.engine.dp_client``: each request runs on one of
them), or on a thread of this one (``AsyncLLM(engine)``). Either way the front sends it
commands and gets one report per step; a reader hands each request's outputs to its ``asyncio.Queue`` with one
``call_soon_threadsafe`` per event loop per step. The engine side (``LLMEngine``'s input and
output processors) tokenizes prompts and detokenizes outputs, since stop strings need the text
as it grows; the deltas it reports carry their text. This side keeps a tokenizer of its own for
what the server asks outside a request (rendering chats, ``/tokenize``, ``/detokenize``,
decoding a logprob's token), so those never wait for a step.

A consumer slower than the engine gets the deltas that piled up merged into one output: a
stream's chunk rate adapts to what its reader can take, and the engine never waits for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import threading
from typing import Any, AsyncIterator

from hookllm.entrypoints.chat import render_chat
from hookllm.config import EngineConfig
from hookllm.engine.llm_engine import LLMEngine
from hookllm.engine.core_client import EngineClient, EngineThread, start_engines
from hookllm.engine.dp_client import DataParallelClient
from hookllm.engine.messages import (AbortRequests, AddRequest, EngineReport, OutputDelta, OutputStream, PooledOutput,
                                     merge_deltas, rebuild_error, unpack_pooled)
from hookllm.inputs import PromptType
from hookllm.lora.request import LoRARequest
from hookllm.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from hookllm.pooling_params import PoolingParams
from hookllm.sampling_params import SamplingParams
from hookllm.sched.scheduler import SchedulerStats
from hookllm.tokenizer import TokenTexts, load_tokenizer
from hookllm.utils import shorten_gil_switch_interval


class EngineStepError(RuntimeError):
    """``engine.step()`` raised (e.g. a plugin's hook) while this request was in the engine."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (``shutdown()``, or its process died); no request can run."""


class _Stream(OutputStream):
    """A request's output queue, on its consumer's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, token_texts: TokenTexts | None):
        super().__init__(token_texts)
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()


# A queued item: an output delta (unpacked by the consumer), the abort's RequestOutput, or an error.
QueueItem = OutputDelta | PooledOutput | RequestOutput | BaseException


def _deliver(items: list[tuple[asyncio.Queue, QueueItem]]) -> None:
    for output_queue, item in items:
        output_queue.put_nowait(item)


class AsyncLLM:
    """Async ``generate`` / ``abort`` over one engine loop.

    ``AsyncLLM(engine)`` steps an engine built here on a thread; ``AsyncLLM(config=config)``
    (or ``from_engine_config``) builds it in a process of its own, or ``config.data_parallel_size``
    engines in processes of their own; ``AsyncLLM(config=config, connections=conns)`` is one more
    client of engine processes already running (``conns``: one of each engine's
    ``EngineProcess.client_conns``, in engine order).
    """

    def __init__(self, engine: LLMEngine | None = None, *, config: EngineConfig | None = None,
                 connections: list[Any] | None = None):
        if (engine is None) == (config is None):
            raise TypeError("AsyncLLM takes an engine or a config, not both")
        if engine is not None and engine.config.data_parallel_size > 1:
            raise ValueError("an engine built in this process is one engine: data parallelism starts engine "
                             "processes (AsyncLLM(config=...))")
        if config is not None and connections is not None and len(connections) != config.data_parallel_size:
            raise ValueError(f"{len(connections)} engine connections for data_parallel_size "
                             f"{config.data_parallel_size}")
        self._streams: dict[str, _Stream] = {}
        self._adding: dict[str, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self._stopped = threading.Event()
        self._lock = threading.Lock()  # the streams' table: the event loop adds, the reader removes
        if engine is not None:
            self.config, self.model_config, self.hooks = engine.config, engine.model_config, engine.hooks
            self._stats = engine.get_stats()
            self._loop: EngineThread | EngineClient = EngineThread(engine, self._on_report)
        else:
            from hookllm.hub import with_local_paths
            from hookllm.plugins.manager import PluginManager
            from hookllm.worker.worker import resolve_model

            config = with_local_paths(config)
            # This side needs the model's config and the hooks that run here (render_content_part,
            # add_routes), not its weights: those load in the engine process.
            self.config = config
            self.model_config, self.hooks = resolve_model(config, PluginManager())
            self._stats = SchedulerStats(0, 0, 0, 0)  # until the loop's first report, which the client awaits
            processes = None
            if connections is None:
                processes = start_engines(config)
                connections = [process.client_conns[0] for process in processes]
            # else: a client of engine processes started elsewhere (hookllm serve --api-server-count)
            if len(connections) == 1:
                self._loop = EngineClient(connections[0], self._on_report, self._on_exit,
                                          processes[0] if processes else None)
            else:
                self._loop = DataParallelClient(connections, self._on_report, self._on_exit, processes)
        # The engine thread, or the thread reading the engine process's reports, shares the GIL
        # with the event loop: a busy loop would hold it off, and a report not read in time
        # blocks the engine process on its pipe.
        shorten_gil_switch_interval()
        # Its own tokenizer: the engine's is busy (and not safe to share) on the engine's thread.
        self.tokenizer = load_tokenizer(self.config.tokenizer or self.config.model)
        self.token_texts = TokenTexts(self.tokenizer) if self.tokenizer is not None else None  # logprobs' texts
        if self.hooks.context.tokenizer is None:  # this side's hooks (add_routes, render_content_part)
            self.hooks.context.tokenizer = self.tokenizer

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> "AsyncLLM":
        """The engine in a process of its own, built from ``config`` (plugins found by name)."""
        return cls(config=config)

    @property
    def active_plugins(self) -> list[str]:
        return self.hooks.plugin_names

    @property
    def is_running(self) -> bool:
        return not self._stopped.is_set()

    def wait_stopped(self, timeout_s: float | None = None) -> bool:
        """Wait until the engine loop has stopped (shut down, or its process died); True if it has."""
        return self._stopped.wait(timeout_s)

    def get_stats(self) -> SchedulerStats:
        """Running/waiting requests and KV use as of the engine's last report (no waiting on a
        step; its first comes as it starts, before any request); summed over the engines under
        data parallelism."""
        return self._stats

    def engine_stats(self) -> list[SchedulerStats]:
        """``get_stats`` of each engine, in engine order (one entry without data parallelism)."""
        return self._loop.engine_stats() if isinstance(self._loop, DataParallelClient) else [self._stats]

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    async def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    async def render_chat(self, conversation: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        """``hookllm.entrypoints.chat.render_chat`` with this side's tokenizer and hooks."""
        return render_chat(self, conversation, **kwargs)

    async def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request (run with ``lora_request``'s adapter, if any) and yield its outputs as
        they come, each holding only what is new (several steps' worth when the consumer fell behind).

        ``ValueError`` from ``add_request`` (bad input) is raised here before anything is yielded.
        Closing or cancelling the iterator before the request finishes aborts it at once.
        """
        request_id = request_id or f"async-{next(self._ids)}"
        # Deltas never take text back: the engine holds back what a stop string may still cut.
        stream, added = self._add(request_id, prompt, dataclasses.replace(params, output_kind="delta"), lora_request)
        finished = False
        try:
            await asyncio.wrap_future(added)
            while not finished:
                item = await stream.queue.get()
                # Whatever else is already queued goes out with it, as one delta. Queued outputs
                # are output deltas, unpacked here: the thread reading the engine's reports only
                # routes them, so it holds the GIL as briefly as it can.
                while type(item) is OutputDelta and not item.finished and not stream.queue.empty():
                    later = stream.queue.get_nowait()
                    if type(later) is not OutputDelta:  # an error, or the abort's output: after this delta
                        stream.queue.put_nowait(later)  # (nothing else is queued)
                        break
                    item = merge_deltas(item, later)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                output = stream.unpack(item) if type(item) is OutputDelta else item
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    async def encode(self, prompt: PromptType, params: PoolingParams, request_id: str | None = None,
                     lora_request: LoRARequest | None = None) -> PoolingRequestOutput:
        """Run a pooling request (the pooling runner's) and return its output. ``ValueError`` for
        bad input; cancelling the call aborts the request."""
        request_id = request_id or f"async-{next(self._ids)}"
        stream, added = self._add(request_id, prompt, params, lora_request)
        finished = False
        try:
            await asyncio.wrap_future(added)
            item = await stream.queue.get()
            finished = True
            if isinstance(item, BaseException):
                raise item
            if type(item) is not PooledOutput:  # aborted meanwhile (its final output)
                raise EngineDeadError(f"request {request_id} was aborted")
            return unpack_pooled(item)
        finally:
            if not finished:
                self.abort(request_id)

    def _add(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
             lora_request: LoRARequest | None = None) -> tuple[_Stream, concurrent.futures.Future]:
        """Open the request's stream and send it to the engine; the future resolves once the
        engine took it (or refused it)."""
        stream = _Stream(asyncio.get_running_loop(), self.token_texts)
        added: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._stopped.is_set():
                raise EngineDeadError("the engine is shut down")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._adding[request_id] = added
        self._loop.send(AddRequest(request_id, prompt, params, lora_request))
        return stream, added

    def abort(self, request_id: str) -> None:
        """Abort a request (from any thread): its blocks are freed before the next step; its
        consumer, if any, gets a final output with ``finish_reason="abort"``."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
            self._adding.pop(request_id, None)
        if stream is not None:
            aborted = RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], finish_reason="abort")], True)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, aborted)
        if not self._stopped.is_set():
            self._loop.send(AbortRequests([request_id]))

    def shutdown(self) -> None:
        """Stop the engine loop; requests still running are aborted and their consumers get an error.
        Under data parallelism one engine may have died already: the others are stopped here."""
        self._loop.close()
        self._on_exit()

    def _on_report(self, report: EngineReport) -> None:
        """On the engine thread or the reader thread: hand a step's outputs to their streams."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}

        def put(stream: _Stream, item: QueueItem) -> None:
            batches.setdefault(stream.loop, []).append((stream.queue, item))

        with self._lock:
            for added in report.added:
                future = self._adding.pop(added.request_id, None)
                if future is None:
                    continue  # aborted meanwhile
                if added.error is None:
                    future.set_result(None)
                else:
                    self._streams.pop(added.request_id, None)
                    future.set_exception(rebuild_error(added.error))
            if report.failed_ids:
                failure = EngineStepError(report.failure)
                for request_id in report.failed_ids:
                    stream = self._streams.pop(request_id, None)
                    if stream is not None:
                        put(stream, failure)
            for pooled in report.pooled:
                stream = self._streams.pop(pooled.request_id, None)
                if stream is not None:
                    put(stream, pooled)
            for delta in report.outputs:
                stream = self._streams.get(delta.request_id)
                if stream is None:
                    continue  # aborted: its consumer already has its last output
                if delta.finished:
                    del self._streams[delta.request_id]
                put(stream, delta)
        self._stats = report.stats
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: nobody is left to tell
                pass

    def _on_exit(self) -> None:
        """The loop has stopped (shut down, or its process died): fail whatever still waits."""
        self._stopped.set()
        error = EngineDeadError("the engine is shut down")
        with self._lock:
            streams, self._streams = self._streams, {}
            adding, self._adding = self._adding, {}
        for future in adding.values():
            if not future.done():
                future.set_exception(error)
        for stream in streams.values():
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
            except RuntimeError:
                pass
