"""Data parallelism's client side: one ``EngineClient`` per engine process behind one ``send``.

``hookllm serve --data-parallel-size D`` runs D whole engines (``start_engines``); each API
server process is a client of all of them. ``DataParallelClient`` sends a new request to the
engine with the least work (``least_loaded``), an abort to the engine that holds the request,
and hands every engine's reports on as one engine's would be, their stats summed
(``total_stats``), so that ``AsyncLLM`` serves D engines as it serves one.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, Callable, Sequence

from hookllm.engine.core_client import EngineClient, EngineProcess
from hookllm.engine.messages import AbortRequests, AddRequest, Command, EngineReport, Shutdown
from hookllm.sched.scheduler import SchedulerStats


def least_loaded(stats: Sequence[SchedulerStats], unreported: Sequence[int]) -> int:
    """The engine to send a new request to: the fewest waiting + running requests as of its last
    report, plus the requests sent to it that no report counts yet (a burst between two reports
    then spreads instead of landing on one engine); ties go to the lowest index."""
    loads = [s.num_waiting_reqs + s.num_running_reqs + sent for s, sent in zip(stats, unreported, strict=True)]
    return loads.index(min(loads))


def total_stats(stats: Sequence[SchedulerStats]) -> SchedulerStats:
    """One ``SchedulerStats`` for several engines: every count summed (so ``kv_cache_usage`` is
    the used blocks over all blocks of all engines), every list of names merged."""
    def total(values: list) -> object:
        return sorted(set().union(*values)) if isinstance(values[0], list) else sum(values)

    return SchedulerStats(*(total([getattr(s, f.name) for s in stats]) for f in dataclasses.fields(SchedulerStats)))


class DataParallelClient:
    """A client of each of several engine processes (``conns``: this side's pipe to each, in
    engine order), used as one ``EngineClient`` is: ``send`` and ``close``.

    Every engine's reports reach ``deliver`` with ``stats`` replaced by the sum over engines;
    ``engine_stats`` gives each one's. An engine that stops calls ``on_exit`` (the server is down
    then). With ``processes`` (the engines this client started), ``close`` also waits for them.
    Returns once every engine's first report has arrived.
    """

    def __init__(self, conns: Sequence[Any], deliver: Callable[[EngineReport], None], on_exit: Callable[[], None],
                 processes: Sequence[EngineProcess] | None = None):
        self._deliver = deliver
        self._lock = threading.Lock()  # the tables below: the event loop sends, each engine's reader reports
        self._stats = [SchedulerStats(0, 0, 0, 0) for _ in conns]
        self._unreported = [0] * len(conns)  # requests sent to each engine that its reports do not count yet
        self._engine_of: dict[str, int] = {}  # each unfinished request's engine
        processes = processes or [None] * len(conns)
        self._clients = [EngineClient(conn, functools.partial(self._on_report, index), on_exit, process)
                         for index, (conn, process) in enumerate(zip(conns, processes, strict=True))]

    def engine_stats(self) -> list[SchedulerStats]:
        """Each engine's stats as of its last report, in engine order."""
        with self._lock:
            return list(self._stats)

    def send(self, command: Command) -> None:
        """A new request to the least loaded engine, an abort to the engines holding its requests,
        anything else (shutdown) to every engine."""
        if type(command) is AddRequest:
            with self._lock:
                index = least_loaded(self._stats, self._unreported)
                self._unreported[index] += 1
                self._engine_of[command.request_id] = index
            self._clients[index].send(command)
        elif type(command) is AbortRequests:
            by_engine: dict[int, list[str]] = {}
            with self._lock:
                for request_id in command.request_ids:
                    index = self._engine_of.pop(request_id, None)
                    if index is not None:  # None: it has finished already
                        by_engine.setdefault(index, []).append(request_id)
            for index, request_ids in by_engine.items():
                self._clients[index].send(AbortRequests(request_ids))
        else:
            for client in self._clients:
                client.send(command)

    def close(self, timeout_s: float = 30.0) -> None:
        # Every engine hears shutdown before any is waited for: they stop side by side.
        self.send(Shutdown())
        for client in self._clients:
            client.close(timeout_s)

    def _on_report(self, index: int, report: EngineReport) -> None:
        """On engine ``index``'s reader thread: note its stats and which of its requests ended,
        then hand the report on with the stats of all engines."""
        with self._lock:
            self._stats[index] = report.stats
            self._unreported[index] -= len(report.added)  # this report's stats count them
            ended = [added.request_id for added in report.added if added.error is not None]
            ended += report.failed_ids
            ended += [delta.request_id for delta in report.outputs if delta.finished]
            ended += [pooled.request_id for pooled in report.pooled]
            for request_id in ended:
                self._engine_of.pop(request_id, None)
            report.stats = total_stats(self._stats)
        self._deliver(report)
