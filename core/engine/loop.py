"""The engine loop: commands in, one engine step at a time, reports out, all as typed messages.

``EngineLoop`` steps an ``LLMEngine`` while any request is unfinished; between steps it runs the
commands its clients sent (add, abort, shut down); idle, it blocks waiting for one. As it starts
it sends each client a report with the engine's stats alone (a server's gauges are right before
any request); after each step, one ``EngineReport`` with its requests' new tokens and text.
Where it runs (a thread of this process, or a process of its own) is ``hookllm.engine.core_client``'s.
"""

from __future__ import annotations

import logging
from typing import Callable

from hookllm.worker.multiproc_executor import WorkerError
from hookllm.engine.llm_engine import LLMEngine
from hookllm.engine.messages import (AbortRequests, AddRequest, Command, EngineReport, RequestAdded, Shutdown,
                                     pack_output, pack_pooled)
from hookllm.outputs import PoolingRequestOutput
from hookllm.sched.scheduler import SchedulerStats

logger = logging.getLogger(__name__)


class EngineLoop:
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
        """A first report with the stats alone, then until every client has said shutdown (or is
        gone): commands, a step, a report each."""
        try:
            reports = self._send_reports(self._new_reports(self.engine.get_stats()))
            while self._run_commands(reports, block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._step(reports)
                reports = self._send_reports(reports)
        finally:
            self.engine.abort_request(self.engine.unfinished_request_ids())
            for client in self.clients:
                self.send(client, EngineReport(self.engine.get_stats(), closed=True))

    def _send_reports(self, reports: dict[int, EngineReport]) -> dict[int, EngineReport]:
        """Send each client its report with the current stats; the next turn's empty reports."""
        stats = self.engine.get_stats()
        for client in self.clients:
            reports[client].stats = stats
            self.send(client, reports[client])
        return self._new_reports(stats)

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
            if type(command) is AddRequest:
                try:
                    self.engine.add_request(command.request_id, command.prompt, command.params, command.lora_request)
                    self.owner[command.request_id] = client
                    reports[client].added.append(RequestAdded(command.request_id))
                except Exception as exc:  # noqa: BLE001 - bad input: the caller's error, sent back to it
                    reports[client].added.append(RequestAdded(command.request_id, (type(exc).__name__, str(exc))))
            elif type(command) is AbortRequests:
                self.engine.abort_request(command.request_ids)
                self._forget(command.request_ids)
            elif type(command) is Shutdown:
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
                raise ValueError(f"unknown engine command {command!r}")
        return True

    def _step(self, reports: dict[int, EngineReport]) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a plugin's error fails its requests, not the server
            logger.exception("engine step failed")
            # The engine has aborted every request it held (LLMEngine.step): each client hears
            # of its own, and requests added afterwards run normally.
            failed: dict[int, list[str]] = {}
            for request_id, client in self.owner.items():
                failed.setdefault(client, []).append(request_id)
            self.owner.clear()
            self.head_sent.clear()
            for client, report in reports.items():
                report.failed_ids = failed.get(client, [])
                report.failure = f"the engine step failed: {type(exc).__name__}: {exc}"
            if isinstance(exc, WorkerError):  # its ranks are gone: no later step can run
                self._send_reports(reports)
                raise
            return
        for output in outputs:
            rid = output.request_id
            if type(output) is PoolingRequestOutput:
                reports[self.owner[rid]].pooled.append(pack_pooled(output))
                self._forget([rid])
                continue
            reports[self.owner[rid]].outputs.append(pack_output(output, with_head=rid not in self.head_sent))
            if output.finished:
                self._forget([rid])
            else:
                self.head_sent.add(rid)
