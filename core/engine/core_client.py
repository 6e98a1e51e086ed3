"""The engine loop: commands in, one step at a time, outputs out, all as plain data.

``EngineCore`` owns an ``LLMEngine`` and steps it while any request is unfinished; between steps
it runs the commands its client sent (add, abort, shut down); idle, it blocks waiting for one.
After each step it sends one ``EngineReport`` holding every request's new tokens and text.

It runs in one of two places, with the same loop and the same messages:

- ``EngineProcess``: a process of its own (what ``hookllm serve`` uses). The API server's event
  loop and the engine's step then never wait for each other's GIL; messages cross a pipe. One
  engine process can serve several clients (``hookllm serve --api-server-count N``: one pipe per
  API server process); each request's outputs go back to the client that added it.
- ``EngineThread``: a thread of the caller's process, for an engine built in-process (plugins
  given as objects, tests).

Outputs travel as tuples, not ``RequestOutput`` objects: pickling a step's worth of dataclasses
costs milliseconds, the tuples tens of microseconds. A request's prompt goes once, with its
first output; the client puts the ``RequestOutput`` back together (``OutputStream.unpack``), in
the consumer, after merging the deltas that piled up (``merge_wire``).
"""

from __future__ import annotations

import atexit
import collections
import logging
import multiprocessing
import multiprocessing.connection
import queue
import signal
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from hookllm.config import EngineConfig
from hookllm.engine.llm_engine import LLMEngine
from hookllm.outputs import CompletionOutput, RequestOutput
from hookllm.sched.scheduler import SchedulerStats
from hookllm.utils import name_this_process

logger = logging.getLogger(__name__)

# Commands, client to engine: ("add", request_id, prompt, params) | ("abort", [request_id, ...])
# | ("shutdown",): this client is done (its requests are aborted; the loop stops with the last).
Command = tuple
# One output on the wire: (request_id, finished, head, completions, metrics), where head is
# (prompt, prompt_token_ids, prompt_logprobs, num_cached_tokens) in a request's first output and
# None after, completions is a list of (index, text, token_ids, cumulative_logprob, logprobs,
# finish_reason, stop_reason), and metrics is the RequestMetrics of a finished request.
WireOutput = tuple


@dataclass
class EngineReport:
    """What one turn of the loop tells the client."""

    stats: SchedulerStats
    outputs: list[WireOutput] = field(default_factory=list)
    # (request_id, None) for each request added, (request_id, (error type name, message)) if refused.
    added: list[tuple[str, tuple[str, str] | None]] = field(default_factory=list)
    # A failed step: the requests it failed and why.
    failed_ids: list[str] = field(default_factory=list)
    failure: str = ""
    closed: bool = False  # the last report: the loop has stopped and aborted what was left


def pack_output(output: RequestOutput, with_head: bool) -> WireOutput:
    head = ((output.prompt, output.prompt_token_ids, output.prompt_logprobs, output.num_cached_tokens)
            if with_head else None)
    completions = [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason)
                   for c in output.outputs]
    return output.request_id, output.finished, head, completions, output.metrics if output.finished else None


def merge_wire(first: WireOutput, later: WireOutput) -> WireOutput:
    """Two consecutive delta outputs of one request as one: ``later``'s state with both steps'
    new text, token ids and logprobs (and the head, which only a request's first output has)."""
    request_id, finished, head, completions, metrics = later
    merged = {c[0]: c for c in first[3]}
    for c in completions:
        old = merged.get(c[0])
        if old is not None:
            logprobs = old[4] + c[4] if old[4] is not None and c[4] is not None else c[4]
            c = (c[0], old[1] + c[1], old[2] + c[2], c[3], logprobs, c[5], c[6])
        merged[c[0]] = c
    return request_id, finished, first[2] if first[2] is not None else head, [merged[i] for i in sorted(merged)], metrics


def rebuild_error(error: tuple[str, str]) -> Exception:
    """An exception raised in the engine, as the client raises it: bad input stays a ValueError."""
    name, message = error
    kinds = {"ValueError": ValueError, "TypeError": TypeError}
    return kinds[name](message) if name in kinds else RuntimeError(f"{name}: {message}")


class EngineCore:
    """Steps ``engine`` between commands from its clients and reports each turn to each client.

    ``receive(block)`` returns the next ``(client, command)``, or None when ``block`` is False and
    none is waiting; ``send(client, report)`` delivers a report. Clients are numbered
    ``0 .. num_clients - 1``; a request's outputs, its admission and its failure go to the client
    that added it, and the scheduler's stats to every client each turn.
    """

    def __init__(self, engine: LLMEngine, receive: Callable[[bool], tuple[int, Command] | None],
                 send: Callable[[int, EngineReport], None], num_clients: int = 1):
        self.engine = engine
        self.receive = receive
        self.send = send
        self.clients = set(range(num_clients))  # those that have not said shutdown
        self.owner: dict[str, int] = {}  # request id -> the client that added it
        self.head_sent: set[str] = set()  # requests whose first output (with the prompt) was sent

    def run(self) -> None:
        """Until every client has said shutdown (or is gone): commands, a step, a report each."""
        reports = self._new_reports(self.engine.get_stats())
        try:
            while self._run_commands(reports, block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._step(reports)
                stats = self.engine.get_stats()
                for client in self.clients:
                    reports[client].stats = stats
                    self.send(client, reports[client])
                reports = self._new_reports(stats)
        finally:
            self.engine.abort_request(list(self.engine.scheduler.requests))
            for client in self.clients:
                self.send(client, EngineReport(self.engine.get_stats(), closed=True))

    def _new_reports(self, stats: SchedulerStats) -> dict[int, EngineReport]:
        """An empty report per client, holding the last stats until this turn's replace them."""
        return {client: EngineReport(stats) for client in self.clients}

    def _forget(self, request_ids: list[str]) -> None:
        self.head_sent.difference_update(request_ids)
        for request_id in request_ids:
            self.owner.pop(request_id, None)

    def _run_commands(self, reports: dict[int, EngineReport], block: bool) -> bool:
        """Run every waiting command (waiting for one if ``block``); False once no client is left."""
        while (received := self.receive(block)) is not None:
            block = False
            client, command = received
            kind = command[0]
            if kind == "add":
                _, request_id, prompt, params = command
                try:
                    self.engine.add_request(request_id, prompt, params)
                    self.owner[request_id] = client
                    reports[client].added.append((request_id, None))
                except Exception as exc:  # noqa: BLE001 - bad input: the caller's error, sent back to it
                    reports[client].added.append((request_id, (type(exc).__name__, str(exc))))
            elif kind == "abort":
                self.engine.abort_request(command[1])
                self._forget(command[1])
            elif kind == "shutdown":
                if client not in self.clients:
                    continue
                self.clients.discard(client)
                mine = [request_id for request_id, owner in self.owner.items() if owner == client]
                self.engine.abort_request(mine)
                self._forget(mine)
                self.send(client, EngineReport(self.engine.get_stats(), closed=True))
                if not self.clients:
                    return False
            else:
                raise ValueError(f"unknown engine command {kind!r}")
        return True

    def _step(self, reports: dict[int, EngineReport]) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a plugin's error fails its requests, not the server
            logger.exception("engine step failed")
            # The engine does not say which requests the failed step held: fail every request it
            # holds now (those running and any waiting behind them) and free their blocks, as
            # LLM.generate does; requests added afterwards run normally.
            # Every client hears of them all (it skips the ids that are not its own).
            failed_ids = list(dict.fromkeys([*self.engine.scheduler.requests, *self.engine.parallel]))
            self.engine.abort_request(failed_ids)
            self._forget(failed_ids)
            for report in reports.values():
                report.failed_ids = failed_ids
                report.failure = f"the engine step failed: {type(exc).__name__}: {exc}"
            return
        for output in outputs:
            rid = output.request_id
            reports[self.owner[rid]].outputs.append(pack_output(output, with_head=rid not in self.head_sent))
            if output.finished:
                self._forget([rid])
            else:
                self.head_sent.add(rid)


class OutputStream:
    """The client's side of one request: puts its wire outputs back into ``RequestOutput``s."""

    def __init__(self) -> None:
        self.head: tuple | None = None

    def unpack(self, wire: WireOutput) -> RequestOutput:
        request_id, finished, head, completions, metrics = wire
        if head is not None:
            self.head = head
        prompt, prompt_token_ids, prompt_logprobs, num_cached_tokens = self.head
        return RequestOutput(request_id, prompt, prompt_token_ids, [CompletionOutput(*c) for c in completions],
                             finished, prompt_logprobs, metrics, num_cached_tokens)


# --- where the loop runs -------------------------------------------------------------------------

class EngineThread:
    """The loop on a thread of this process, over an engine the caller built (and still owns)."""

    def __init__(self, engine: LLMEngine, deliver: Callable[[EngineReport], None]):
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        core = EngineCore(engine, self._receive, lambda _client, report: deliver(report))
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
        self.commands.put(("shutdown",))
        self.thread.join()


class EngineStartError(RuntimeError):
    """The engine process could not build its engine (the message holds its traceback)."""


class EngineProcess:
    """The loop in a process of its own, serving ``num_clients`` clients: ``client_conns`` holds
    this side's end of each one's pipe (give each to an ``EngineClient``, here or in another
    process). Returns once the engine is built; a failure to build it is raised here."""

    def __init__(self, config: EngineConfig, num_clients: int = 1):
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        pipes = [context.Pipe() for _ in range(num_clients)]
        self.client_conns = [ours for ours, _ in pipes]
        # Not a daemon: under tensor parallelism it starts the rank processes itself.
        self.process = context.Process(target=_engine_process_main, args=(config, [theirs for _, theirs in pipes]),
                                       name="hookllm-engine-core")
        self.process.start()
        for _, theirs in pipes:
            theirs.close()
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

    def join(self, timeout_s: float = 30.0) -> None:
        """Wait for the process to end (it does once every client has shut down or gone)."""
        self.process.join(timeout_s)
        if self.process.is_alive():
            logger.warning("the engine process did not stop within %.0f s; terminating it", timeout_s)
            self.process.terminate()
            self.process.join(10)


class EngineClient:
    """One client of an engine process, over its pipe ``conn``: commands go out with ``send``; a
    reader thread hands each report to ``deliver`` and calls ``on_exit`` when the loop is gone.
    With ``process`` (the client that started it), ``close`` also waits for the process to end."""

    def __init__(self, conn: Any, deliver: Callable[[EngineReport], None], on_exit: Callable[[], None],
                 process: EngineProcess | None = None):
        self.conn = conn
        self.process = process
        self.send_lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, args=(deliver, on_exit), name="hookllm-engine-reader",
                                       daemon=True)
        self.reader.start()
        # A caller that never shuts down must not hang its own exit: multiprocessing joins
        # non-daemon children at exit, and the engine waits for a command until its pipes close.
        atexit.register(self.close)

    def _read(self, deliver: Callable[[EngineReport], None], on_exit: Callable[[], None]) -> None:
        try:
            while True:
                report = self.conn.recv()
                deliver(report)
                if report.closed:
                    return
        except (EOFError, OSError):
            logger.error("the engine process stopped unexpectedly")
        finally:
            on_exit()

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
        self.send(("shutdown",))
        self.reader.join(timeout_s)
        if self.process is not None:
            self.process.join(timeout_s)
        self.conn.close()


def _engine_process_main(config: EngineConfig, conns: list[Any]) -> None:
    # Ctrl-C and SIGTERM reach the whole process group: the API servers decide when the engine
    # stops (after draining), by shutdown commands or by closing their pipes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    name_this_process("hookllm-engine")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
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
                except EOFError:  # that API server is gone: as if it had said shutdown
                    del open_conns[conn]
                    received.append((client, ("shutdown",)))
        return received.popleft() if received else None

    def send(client: int, report: EngineReport) -> None:
        try:
            conns[client].send(report)
        except (BrokenPipeError, OSError):
            pass  # nobody is listening any more; the next receive sees the closed pipe

    try:
        EngineCore(engine, receive, send, num_clients=len(conns)).run()
    finally:
        engine.shutdown()
