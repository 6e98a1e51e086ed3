"""Tensor and pipeline parallelism: one worker process per rank, driven by the engine's plain snapshots.

The engine's process keeps the scheduler and the output processor; ``tensor_parallel_size x
pipeline_parallel_size`` spawned processes each own one shard of one stage of the model and
its KV cache (``hookllm.distributed``, NCCL on GPUs, gloo on the CPU). Each step's
``SchedulerOutput`` goes to every rank through a pipe; the ranks run the same step in lockstep
(the parallel layers' collectives and the stages' sends carry the tensors); the last stage's
ranks sample the same tokens from the same all-gathered logits and generators, and its first
rank (the reporting rank) sends the sampled ids back. A rank that raises sends its error; a rank that dies closes its
sentinel: either ends the engine with an error naming the rank, never a hang.
"""

from __future__ import annotations

from collections import deque
import threading
import time
import traceback
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import torch

from hookllm.config import EngineConfig
from hookllm.outputs import LogprobsRow
from hookllm.sched.output import SchedulerOutput
from hookllm.spec.verify import SpecDecodeOutput
from hookllm.utils import process_context

READY_TIMEOUT_S = 600.0  # loading a large checkpoint and capturing CUDA graphs takes a while
POLL_S = 1.0
# A rank's error can be the echo of another's loss (its collective's peer is gone): how long to
# watch the other ranks for a death before blaming the one that reported.
LOSS_GRACE_S = 0.5


class WorkerError(RuntimeError):
    """A tensor-parallel rank raised or died; the message names the rank and the cause."""


def worker_main(config: EngineConfig, rank: int, init_method: str, conn: Connection,
                device_index: int | None = None) -> None:
    """One rank: join the group, build the worker, then run every snapshot the driver sends
    (over a pipe from the engine's node, or a connection from another node's). On CUDA it runs
    on GPU ``device_index`` (default: its index among its node's ranks)."""
    try:
        import torch

        from hookllm.distributed import init_custom_all_reduce, init_model_parallel
        from hookllm.worker.worker import Worker

        cuda = config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
        from hookllm.worker.multinode import ranks_per_node

        if device_index is None:
            device_index = rank % ranks_per_node(config)
        device = torch.device("cuda", device_index) if cuda else torch.device("cpu")
        init_model_parallel(rank, config.world_size, config.pipeline_parallel_size, "nccl" if cuda else "gloo",
                            init_method, device if cuda else None, config.distributed_timeout)
        if config.custom_all_reduce and cuda:
            init_custom_all_reduce(device)
        worker = Worker.from_config(replace(config, device=str(device)))
        conn.send(("ready", (worker.num_kv_blocks, worker.num_host_blocks, worker.kv_cache_groups,
                             worker.startup_seconds, worker.quantization_summary)))
        sender = _ResultSender(conn) if rank == reporting_rank(config) else None
        previous = None
        while True:
            message = conn.recv()
            if message is None:
                break
            tag, payload = message
            if tag == "rpc":
                conn.send(("rpc", _call(worker, *payload)))
                continue
            scheduler_output, has_previous = payload
            previous = worker.execute(scheduler_output, previous if has_previous else None)
            if previous is not None:
                # Sampled here, not in the sender thread, and by every rank alike (a deferred step
                # might otherwise be left unsampled on some): logits jobs do not overlap under TP,
                # and the stages before the last receive the sampled ids now.
                previous.finish()
            if sender is not None:
                sender.put(previous)
        if sender is not None:
            sender.close()
        worker.shutdown()
    except BaseException:  # noqa: BLE001 - every failure goes to the driver, named by rank
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        from hookllm.distributed import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


def _call(worker: Any, method: Any, args: tuple, kwargs: dict[str, Any] | None) -> tuple[bool, Any]:
    """A ``collective_rpc`` call on this rank: (True, its result) or (False, the traceback); a
    failing call leaves the rank serving."""
    try:
        return True, worker.collective_rpc(method, args, kwargs)[0]
    except Exception:  # noqa: BLE001 - reported to the caller, named by rank
        return False, traceback.format_exc()


def reporting_rank(config: EngineConfig) -> int:
    """The rank that sends each step's sampled ids to the driver: the last stage's first."""
    return config.world_size - config.tensor_parallel_size


class _ResultSender:
    """The reporting rank's sampled tokens go back from a thread, so the rank receives and launches the next
    step while this one's tokens are still being copied to the host."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.pending: list[Any] = []
        self.ready = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def put(self, step_output: Any) -> None:
        with self.ready:
            self.pending.append(step_output)
            self.ready.notify()

    def close(self) -> None:
        self.put(StopIteration)
        self.thread.join()

    def _run(self) -> None:
        while True:
            with self.ready:
                while not self.pending:
                    self.ready.wait()
                step_output = self.pending.pop(0)
            if step_output is StopIteration:
                return
            self.conn.send(("result", (step_output.resolve(), step_output.prompt_logprobs(), step_output.pooled(),
                                       step_output.spec_decode()) if step_output is not None else None))


# The reporting rank's answer for one step: (token ids, logprobs entries), the prompt logprobs by
# request, the pooled outputs by request and a speculating step's emitted tokens and drafts.
RankAnswer = tuple[tuple[list[int], list[LogprobsRow | None]], dict[str, list[LogprobsRow]], dict[str, torch.Tensor],
                   SpecDecodeOutput | None]


class RemoteStepOutput:
    """A step running on the ranks (a ``StepResult``): ``resolve`` reads the reporting rank's
    answer (they come in step order)."""

    def __init__(self, workers: "MultiprocWorkers"):
        self.workers = workers
        self.result: RankAnswer | None = None

    def _answer(self) -> RankAnswer:
        while self.result is None:
            self.workers.receive_next_result()
        return self.result

    def resolve(self) -> tuple[list[int], list[LogprobsRow | None]]:
        return self._answer()[0]

    def prompt_logprobs(self) -> dict[str, list[LogprobsRow]]:
        return self._answer()[1]

    def pooled(self) -> dict[str, torch.Tensor]:
        return self._answer()[2]

    def spec_decode(self) -> SpecDecodeOutput | None:
        return self._answer()[3]

    def token_ids(self) -> list[int]:
        return self.resolve()[0]


class MultiprocWorkers:
    """The driver's handle on ``world_size`` worker processes: the engine's executor
    (``hookllm.worker.executor.Executor``) when the model runs apart."""

    def __init__(self, config: EngineConfig):
        size = config.world_size
        self.reporting_rank = reporting_rank(config)
        self.processes: list[Any] = []  # the ranks this process started (on this node)
        self.conns: list[Connection] = []  # one per rank, in rank order
        self.awaiting: list[RemoteStepOutput] = []  # steps whose tokens have not come back yet
        self.inbox: list[deque[tuple[str, Any]]] = [deque() for _ in range(size)]  # read, not yet taken
        try:
            self._start_ranks(config)
            ready = [self._receive(rank, "ready", READY_TIMEOUT_S) for rank in range(size)]
        except BaseException:
            self.shutdown()
            raise
        device_blocks, host_blocks, groups, startup_seconds, quantization = zip(*ready)
        # Every rank holds its shard of each block (device and host): the smallest cache bounds all.
        self.num_kv_blocks, self.num_host_blocks = min(device_blocks), min(host_blocks)
        # One block table per group for all ranks: each stage's layers must group alike.
        if len({g.windows for g in groups}) > 1:
            self.shutdown()
            raise ValueError("pipeline stages group their layers' sliding windows differently "
                             f"({', '.join(str(g.windows) for g in groups)}); set HOOKLLM_PP_LAYER_PARTITION "
                             "so that every stage holds the same kinds of layers")
        self.kv_cache_groups = groups[0]
        # For the engine's start-up summary: rank 0's, as every rank builds the same.
        self.startup_seconds, self.quantization_summary = startup_seconds[0], quantization[0]

    def _start_ranks(self, config: EngineConfig) -> None:
        """Spawn this node's ranks, each with a pipe; with several nodes, take the connections of
        the others' ranks (``hookllm.worker.multinode``)."""
        from hookllm.worker.multinode import accept_remote_ranks, ranks_per_node

        context = process_context()
        rendezvous = init_method(config)
        for rank in range(ranks_per_node(config)):
            parent, child = context.Pipe()
            process = context.Process(target=worker_main, args=(config, rank, rendezvous, child),
                                      name=f"hookllm-rank{rank}", daemon=True)
            process.start()
            child.close()
            self.processes.append(process)
            self.conns.append(parent)
        if config.nnodes > 1:
            self.conns += accept_remote_ranks(config)

    def execute(self, scheduler_output: SchedulerOutput,
                previous: RemoteStepOutput | None = None) -> RemoteStepOutput | None:
        """Send the step to every rank. A step that schedules nothing returns None, like a local
        worker; any other returns its answer to come (empty when the step sampled nothing)."""
        self._send_all(("step", (scheduler_output, previous is not None)))
        step = RemoteStepOutput(self)
        self.awaiting.append(step)  # the reporting rank answers every step, in order
        return None if scheduler_output.is_empty() else step

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call ``method`` on every rank's worker (a function must pickle): their results by rank.
        Steps still in flight are answered first, so the ranks run it between steps."""
        while self.awaiting:
            self.receive_next_result()
        self._send_all(("rpc", (method, args, kwargs)))
        answers = [self._receive(rank, "rpc", None) for rank in range(len(self.conns))]
        for rank, (ok, value) in enumerate(answers):
            if not ok:
                raise RuntimeError(f"collective_rpc failed on rank {rank}: {value.strip()}")
        return [value for _, value in answers]

    def _send_all(self, message: tuple[str, Any]) -> None:
        for rank, conn in enumerate(self.conns):
            try:
                conn.send(message)
            except OSError:
                self._fail(rank, "its pipe closed")

    def receive_next_result(self) -> None:
        """Take the reporting rank's next answer for the oldest awaiting step."""
        step = self.awaiting.pop(0)
        step.result = self._receive(self.reporting_rank, "result", None) or (([], []), {})

    def _receive(self, rank: int, kind: str, timeout_s: float | None) -> Any:
        """The next message of ``kind`` from ``rank``, watching every rank for errors and deaths."""
        waited = 0.0
        while True:
            if self.inbox[rank]:
                tag, payload = self.inbox[rank].popleft()
                if tag != kind:
                    self._fail(rank, f"sent {tag!r} where {kind!r} was expected")
                return payload
            ready = wait(self.conns + [p.sentinel for p in self.processes], timeout=POLL_S)
            for r, conn in enumerate(self.conns):
                if conn in ready:
                    tag, payload = self._recv(r)
                    if tag == "error":
                        self._fail(*self._blame(r, payload))
                    self.inbox[r].append((tag, payload))
            for r, process in enumerate(self.processes):
                if process.sentinel in ready and not self.conns[r].poll() and not self.inbox[r]:
                    self._fail(r, f"the process exited with code {process.exitcode}")
            waited += POLL_S
            if timeout_s is not None and waited > timeout_s:
                self._fail(rank, f"no {kind!r} message within {timeout_s:.0f} s")

    def _blame(self, reporting: int, cause: str) -> tuple[int, str]:
        """The rank to name for ``reporting``'s error, and why: another rank whose process exits or
        whose connection closes within ``LOSS_GRACE_S`` (messages meanwhile are read past: the
        engine fails either way), else the reporting rank itself."""
        others = [r for r in range(len(self.conns)) if r != reporting]
        deadline = time.monotonic() + LOSS_GRACE_S
        while (left := deadline - time.monotonic()) > 0:
            ready = wait([self.conns[r] for r in others] + [self.processes[r].sentinel for r in others
                                                           if r < len(self.processes)], timeout=left)
            for r in others:
                lost = None
                if self.conns[r] in ready:
                    try:
                        self.conns[r].recv()
                    except (EOFError, OSError):
                        lost = "its connection closed"
                if lost is None and r < len(self.processes) and self.processes[r].sentinel in ready \
                        and not self.conns[r].poll():
                    lost = f"the process exited with code {self.processes[r].exitcode}"
                if lost is not None:
                    return r, f"{lost} (then rank {reporting} failed: {cause.strip()})"
        return reporting, cause

    def _recv(self, rank: int) -> tuple[str, Any]:
        try:
            return self.conns[rank].recv()
        except (EOFError, OSError):
            self._fail(rank, f"the process exited with code {self.processes[rank].exitcode}"
                       if rank < len(self.processes) else "its connection from another node closed")

    def _fail(self, rank: int, cause: str) -> None:
        self.shutdown()
        raise WorkerError(f"worker rank {rank} failed: {cause.strip()}")

    def shutdown(self) -> None:
        """Stop every rank (politely, then by force); safe to call twice."""
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.conns, self.processes = [], []


def init_method(config: EngineConfig) -> str:
    """The ranks' rendezvous: ``master_addr:master_port`` when set (several nodes), else a free
    port of this host."""
    return config.rendezvous or f"tcp://127.0.0.1:{free_port()}"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
