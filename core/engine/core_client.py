"""Where the engine loop runs, and its clients.

- ``EngineProcess``: a process of its own (what ``hookllm serve`` uses). The API server's event
  loop and the engine's step then never wait for each other's GIL; messages cross a pipe. One
  engine process can serve several clients (``hookllm serve --api-server-count N``: one pipe per
  API server process); each request's outputs go back to the client that added it.
  ``start_engines`` starts ``data_parallel_size`` of them at once, each on GPUs of its own.
- ``EngineThread``: a thread of the caller's process, for an engine built in-process (plugins
  given as objects, tests).

Both run the same ``EngineLoop`` with the same messages (``hookllm.engine.messages``).
"""

from __future__ import annotations

import atexit
import collections
import logging
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
import traceback
from typing import Any, Callable

from hookllm.config import EngineConfig
from hookllm.engine.llm_engine import LLMEngine
from hookllm.engine.loop import EngineLoop
from hookllm.engine.messages import Command, EngineReport, Shutdown, decode_report, encode_report, rebuild_error
from hookllm.logging_config import configure_logging, current_level
from hookllm.utils import join_or_kill, name_this_process, process_context

logger = logging.getLogger(__name__)


class EngineThread:
    """The loop on a thread of this process, over an engine the caller built (and still owns)."""

    def __init__(self, engine: LLMEngine, deliver: Callable[[EngineReport], None]):
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        core = EngineLoop(engine, self._receive, lambda _client, report: deliver(report))
        self.thread = threading.Thread(target=core.run, name="hookllm-engine", daemon=True)
        self.thread.start()

    def _receive(self, block: bool) -> tuple[int, Command] | None:
        try:
            return 0, self.commands.get(block=block)
        except queue.Empty:
            return None

    def send(self, command: Command) -> None:
        self.commands.put(command)

    def close(self) -> None:
        self.commands.put(Shutdown())
        self.thread.join()


class EngineStartError(RuntimeError):
    """The engine process could not build its engine (the message holds its traceback)."""


class EngineProcess:
    """The loop in a process of its own, serving ``num_clients`` clients: ``client_conns`` holds
    this side's end of each one's pipe (give each to an ``EngineClient``, here or in another
    process). It starts loading at once; ``wait_ready`` waits until the engine is built (raising
    a failure to build it), so that several engines load side by side (``start_engines``).
    ``cuda_visible_devices``: the GPUs it sees (its ``CUDA_VISIBLE_DEVICES``), None for this
    process's."""

    def __init__(self, config: EngineConfig, num_clients: int = 1, cuda_visible_devices: str | None = None,
                 name: str = "hookllm-engine-core"):
        context = process_context()
        pipes = [context.Pipe() for _ in range(num_clients)]
        self.client_conns = [ours for ours, _ in pipes]
        # Not a daemon: under tensor parallelism it starts the rank processes itself.
        # It logs as this process does (hookllm serve's --log-level): started anew, it inherits no logging setup.
        self.process = context.Process(target=_engine_process_main, name=name, args=(
            config, [theirs for _, theirs in pipes], current_level(), cuda_visible_devices))
        self.process.start()
        for _, theirs in pipes:
            theirs.close()

    def wait_ready(self) -> None:
        """Return once the engine is built; raise why it could not be (after the process ended)."""
        try:
            status, error = self.client_conns[0].recv()
        except EOFError:
            status, error = "failed", None
        if status != "ready":
            self.process.join(10)
            if error is None:
                raise EngineStartError(f"the engine process exited with {self.process.exitcode}")
            name, message, trace = error
            # Bad settings (a ValueError naming the problem) stay what they are; anything else
            # comes with the engine process's traceback.
            raise rebuild_error((name, message)) if name in ("ValueError", "TypeError") else EngineStartError(trace)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop an engine no client uses yet: closing its pipes is every client's shutdown."""
        for conn in self.client_conns:
            conn.close()
        self.join(timeout_s)

    def join(self, timeout_s: float = 30.0) -> bool:
        """Wait up to ``timeout_s`` for the process to end (it does once every client has shut down
        or gone), then kill it: it ignores SIGTERM. True if it ended on its own with status 0."""
        return join_or_kill(self.process, time.monotonic() + timeout_s)


def data_parallel_devices(visible: list[str], data_parallel_size: int, gpus_per_engine: int) -> list[str]:
    """Each data-parallel engine's ``CUDA_VISIBLE_DEVICES``: engine i gets the i-th run of
    ``gpus_per_engine`` of the ``visible`` GPUs (as vLLM splits them)."""
    needed = data_parallel_size * gpus_per_engine
    if len(visible) < needed:
        raise ValueError(f"data_parallel_size {data_parallel_size} x {gpus_per_engine} GPU(s) per engine needs "
                         f"{needed} GPUs; {len(visible)} visible")
    return [",".join(visible[i * gpus_per_engine:(i + 1) * gpus_per_engine]) for i in range(data_parallel_size)]


def engine_devices(config: EngineConfig) -> list[str | None]:
    """Each engine's ``CUDA_VISIBLE_DEVICES`` (None: this process's): its own GPUs on CUDA under
    data parallelism, counted without initialising CUDA here."""
    import torch

    size = config.data_parallel_size
    cuda = config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
    if size == 1 or not cuda:
        return [None] * size
    if config.device != "cuda" and config.device != "auto":
        raise ValueError(f"device {config.device} pins one GPU, but data_parallel_size {size} gives each engine "
                         f"GPUs of its own (use device cuda)")
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = ([d.strip() for d in listed.split(",") if d.strip()] if listed is not None
               else [str(i) for i in range(torch.cuda.device_count())])
    return data_parallel_devices(visible, size, config.world_size)


def start_engines(config: EngineConfig, num_clients: int = 1) -> list[EngineProcess]:
    """``config.data_parallel_size`` engine processes, each serving ``num_clients`` clients, loading
    side by side (on CUDA each on GPUs of its own). Returns once every one is built; if one fails,
    the others are stopped and its error is raised."""
    devices = engine_devices(config)  # too few GPUs is an error before anything starts
    names = ["hookllm-engine-core"] if len(devices) == 1 else [f"hookllm-engine-core-{i}" for i in range(len(devices))]
    engines: list[EngineProcess] = []
    try:
        for cuda_visible_devices, name in zip(devices, names):
            engines.append(EngineProcess(config, num_clients, cuda_visible_devices, name))
        for engine in engines:
            engine.wait_ready()
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    return engines


class EngineClient:
    """One client of an engine process, over its pipe ``conn``: commands go out with ``send``; a
    reader thread hands each report to ``deliver`` and calls ``on_exit`` when the loop is gone.
    With ``process`` (the client that started it), ``close`` also waits for the process to end.
    Returns once the loop's first report (the engine's stats, sent as it starts) is delivered,
    or the loop is gone."""

    def __init__(self, conn: Any, deliver: Callable[[EngineReport], None], on_exit: Callable[[], None],
                 process: EngineProcess | None = None):
        self.conn = conn
        self.process = process
        self.send_lock = threading.Lock()
        self.started = threading.Event()
        self.reader = threading.Thread(target=self._read, args=(deliver, on_exit), name="hookllm-engine-reader",
                                       daemon=True)
        self.reader.start()
        # A caller that never shuts down must not hang its own exit: multiprocessing joins
        # non-daemon children at exit, and the engine waits for a command until its pipes close.
        atexit.register(self.close)
        # The caller's view of the engine (a server's gauges: its KV blocks) is right from the start.
        self.started.wait()

    def _read(self, deliver: Callable[[EngineReport], None], on_exit: Callable[[], None]) -> None:
        try:
            while True:
                report = decode_report(self.conn.recv_bytes())
                deliver(report)
                if not self.started.is_set():
                    self.started.set()
                if report.closed:
                    return
        except (EOFError, OSError):
            logger.error("the engine process stopped unexpectedly")
        finally:
            on_exit()
            self.started.set()

    def send(self, command: Command) -> None:
        with self.send_lock:  # commands come from the event loop and from other threads
            try:
                self.conn.send(command)
            except (BrokenPipeError, OSError):
                pass  # the process is gone; the reader has failed every request

    def close(self, timeout_s: float = 30.0) -> None:
        if self.conn.closed:
            return
        atexit.unregister(self.close)
        self.send(Shutdown())
        self.reader.join(timeout_s)
        if self.process is not None:
            self.process.join(timeout_s)
        self.conn.close()


def _engine_process_main(config: EngineConfig, conns: list[Any], log_level: int,
                         cuda_visible_devices: str | None) -> None:
    if cuda_visible_devices is not None:  # before anything initializes CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    # Ctrl-C and SIGTERM reach the whole process group: the API servers decide when the engine
    # stops (after draining), by shutdown commands or by closing their pipes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    name_this_process("hookllm-engine")
    configure_logging(log_level)
    try:
        engine = LLMEngine(config)
    except BaseException as exc:  # noqa: BLE001 - told to the parent, which raises it
        conns[0].send(("failed", (type(exc).__name__, str(exc), traceback.format_exc())))
        return
    conns[0].send(("ready", None))
    open_conns = {conn: client for client, conn in enumerate(conns)}
    received: collections.deque = collections.deque()

    def receive(block: bool) -> tuple[int, Command] | None:
        if not received and open_conns:
            for conn in multiprocessing.connection.wait(list(open_conns), timeout=None if block else 0):
                client = open_conns[conn]
                try:
                    while True:  # all that this client has sent, in order
                        received.append((client, conn.recv()))
                        if not conn.poll():
                            break
                except (EOFError, ConnectionResetError):
                    # That API server is gone (one that exits with reports still unread resets its
                    # end of the pipe rather than closing it): as if it had said shutdown.
                    del open_conns[conn]
                    received.append((client, Shutdown()))
        return received.popleft() if received else None

    def send(client: int, report: EngineReport) -> None:
        try:
            conns[client].send_bytes(encode_report(report))
        except (BrokenPipeError, OSError):
            pass  # nobody is listening any more; the next receive sees the closed pipe

    try:
        EngineLoop(engine, receive, send, num_clients=len(conns)).run()
    finally:
        engine.shutdown()
