"""Ranks on several hosts: the multiprocessing executor across nodes (``--nnodes``).

Every node runs the same command with its own ``--node-rank``; node 0 runs the engine (and the
API server), the others run ``--headless``: ranks only. Node ``n`` holds ranks
``n * per_node .. (n + 1) * per_node - 1`` (``per_node = world_size / nnodes``), each on the
node's GPU of its local index. The ranks rendezvous through torch.distributed's TCP store at
``master_addr:master_port`` (on node 0's first rank); the driver's steps reach the other nodes'
ranks over a connection each to ``master_addr:master_port + 1``, where the engine listens
(``multiprocessing.connection``, authenticated). Each rank first says who it is: a rank whose
model or sizes differ from the engine's is refused, each difference named.

A node that never joins within ``distributed_timeout`` seconds, a master no rank can reach,
and a rank that dies all end with an error; a headless node whose parent dies takes its ranks
with it (Linux's parent-death signal), so no rank outlives its node's command.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import multiprocessing.connection
import signal
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from hookllm.config import EngineConfig

logger = logging.getLogger(__name__)

AUTHKEY = b"hookllm-ranks"  # keeps strays out; the port must be reachable only inside the cluster
CONNECT_RETRY_S = 0.5


def ranks_per_node(config: EngineConfig) -> int:
    return config.world_size // config.nnodes


def step_address(config: EngineConfig) -> tuple[str, int]:
    """Where the engine listens for the other nodes' ranks: the port after the rendezvous port."""
    return config.master_addr, config.master_port + 1


def rank_identity(config: EngineConfig) -> dict[str, Any]:
    """What every rank must agree on with the engine: the model (its config.json's digest, as
    paths differ between hosts) and the engine's sizes."""
    config_json = Path(config.model) / "config.json"
    digest = hashlib.sha256(config_json.read_bytes()).hexdigest()[:16] if config_json.is_file() else config.model
    return {"model config.json": digest, "tensor_parallel_size": config.tensor_parallel_size,
            "pipeline_parallel_size": config.pipeline_parallel_size, "nnodes": config.nnodes,
            "dtype": config.dtype, "quantization": config.quantization}


def identity_mismatches(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Each field where a rank's identity differs from the engine's, named with both values."""
    return [f"{key} {ours[key]!r} here, {theirs.get(key)!r} there" for key in ours if theirs.get(key) != ours[key]]


def accept_remote_ranks(config: EngineConfig) -> list[Connection]:
    """On the engine's node: the connections of every rank on the other nodes, by rank."""
    listener = multiprocessing.connection.Listener(step_address(config), backlog=config.world_size,
                                                   authkey=AUTHKEY)
    ranks = range(ranks_per_node(config), config.world_size)
    return accept_ranks(listener, ranks, rank_identity(config), config.distributed_timeout)


def accept_ranks(listener: multiprocessing.connection.Listener, ranks: range, identity: dict[str, Any],
                 timeout_s: float) -> list[Connection]:
    """The connection of each of ``ranks``, in rank order, once all have joined on ``listener``
    (closed then). ``WorkerError`` if some have not within ``timeout_s``, or one disagrees with
    ``identity`` (the engine's :func:`rank_identity`)."""
    from hookllm.worker.multiproc_executor import WorkerError

    expected = set(ranks)
    conns: dict[int, Connection] = {}
    problems: list[str] = []

    def accept_all() -> None:
        while len(conns) < len(expected) and not problems:
            try:
                conn = listener.accept()
                tag, (rank, theirs) = conn.recv()
            except (OSError, EOFError, multiprocessing.AuthenticationError, ValueError, TypeError):
                return  # the listener closed (the deadline passed), or a stray connection
            mismatches = identity_mismatches(identity, theirs)
            if tag != "hello" or rank not in expected or rank in conns or mismatches:
                problems.append(f"rank {rank} disagrees with the engine: {'; '.join(mismatches)}" if mismatches
                                else f"an unexpected rank {rank!r} joined")
                conn.close()
                return
            conns[rank] = conn

    joining = threading.Thread(target=accept_all, name="hookllm-accept-ranks", daemon=True)
    joining.start()
    joining.join(timeout_s)
    listener.close()  # ends a pending accept
    joining.join(5.0)
    if problems or len(conns) < len(expected):
        for conn in conns.values():
            conn.close()
        missing = sorted(expected - set(conns))
        raise WorkerError(problems[0] if problems else
                          f"ranks {missing} did not join within {timeout_s:.0f} s (distributed_timeout)")
    return [conns[rank] for rank in sorted(conns)]


def _connect(config: EngineConfig) -> Connection:
    """This rank's connection to the engine, retried until ``distributed_timeout``: the engine's
    node may still be starting."""
    deadline = time.monotonic() + config.distributed_timeout
    while True:
        try:
            return multiprocessing.connection.Client(step_address(config), authkey=AUTHKEY)
        except OSError as exc:
            if time.monotonic() > deadline:
                host, port = step_address(config)
                raise ConnectionError(f"cannot reach the engine at {host}:{port} (master_addr, master_port + 1) "
                                      f"within {config.distributed_timeout:.0f} s: {exc}") from None
            time.sleep(CONNECT_RETRY_S)


def _remote_rank_main(config: EngineConfig, rank: int) -> None:
    """A rank on a headless node: connect to the engine, say who it is, then serve its steps."""
    from hookllm.worker.multiproc_executor import init_method, worker_main

    _die_with_parent()
    conn = _connect(config)
    conn.send(("hello", (rank, rank_identity(config))))
    worker_main(config, rank, init_method(config), conn)


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent (the node's command) dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_headless(config: EngineConfig) -> int:
    """A node that runs ranks only (``hookllm serve --headless``): start this node's ranks, wait
    for them; SIGTERM or SIGINT stops them. 0 when every rank ended cleanly (the engine stopped
    them), 1 when one failed (the others are then stopped)."""
    # Spawned, not from a fork server: each rank is this command's own child, so that it dies with it.
    context = multiprocessing.get_context("spawn")
    per_node = ranks_per_node(config)
    ranks = range(config.node_rank * per_node, (config.node_rank + 1) * per_node)
    processes = [context.Process(target=_remote_rank_main, args=(config, rank), name=f"hookllm-rank{rank}")
                 for rank in ranks]
    for process in processes:
        process.start()
    logger.info("node %d of %d: ranks %d-%d started, joining the engine at %s:%d", config.node_rank,
                config.nnodes, ranks[0], ranks[-1], *step_address(config))
    signalled = threading.Event()

    def terminate_all() -> None:
        for process in processes:
            if process.is_alive():
                process.terminate()

    def stop(signum: int, frame: Any) -> None:
        signalled.set()
        terminate_all()

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGINT)}
    failed = False
    try:
        running = {process.sentinel: process for process in processes}
        while running:
            for sentinel in multiprocessing.connection.wait(list(running)):
                process = running.pop(sentinel)
                process.join()
                if process.exitcode != 0 and not signalled.is_set() and not failed:
                    logger.error("%s exited with code %s: stopping this node's ranks", process.name, process.exitcode)
                    failed = True
                    terminate_all()
        return 1 if failed else 0
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
