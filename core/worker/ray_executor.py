"""The Ray executor (``distributed_executor_backend="ray"``): each rank a Ray actor.

The engine joins the running Ray cluster (``ray start --head`` on one node and ``ray start
--address=...`` on the others; ``RAY_ADDRESS`` names it, else Ray's ``auto`` finds the local
one), reserves one bundle per rank (a GPU each on CUDA, a CPU each otherwise) in a placement
group packed onto as few nodes as it can, and starts one actor per bundle. Ray only places and
starts the ranks: each actor connects back to the engine for its steps, says who it is and
runs them as every rank on another node does (:mod:`hookllm.worker.multinode`), so the steps,
the answers and the failures (an actor that dies closes its connection: ``WorkerError``) are
the multiprocessing executor's. The model's path must be readable on every node.
"""

from __future__ import annotations

import multiprocessing.connection
import os

from hookllm.config import EngineConfig
from hookllm.worker.multinode import AUTHKEY, accept_ranks, rank_identity
from hookllm.worker.multiproc_executor import MultiprocWorkers, WorkerError, free_port, worker_main

class RankActor:
    """One rank in a Ray worker process (made a Ray actor class by :class:`RayWorkers`)."""

    def run(self, config: EngineConfig, rank: int, engine_address: tuple[str, int], rendezvous: str) -> None:
        """Connect to the engine, say who this rank is, then serve its steps until it stops them."""
        conn = multiprocessing.connection.Client(engine_address, authkey=AUTHKEY)
        conn.send(("hello", (rank, rank_identity(config))))
        worker_main(config, rank, rendezvous, conn, device_index=0)  # Ray shows each actor its GPU alone


class RayWorkers(MultiprocWorkers):
    """``MultiprocWorkers`` whose ranks Ray places and starts."""

    def _start_ranks(self, config: EngineConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS", "auto")
            try:
                ray.init(address=address, log_to_driver=False)
            except ConnectionError as exc:
                raise ValueError(f"no Ray cluster to join at {address!r} (start one with `ray start --head`, or set "
                                 f"RAY_ADDRESS): {exc}") from None
        self.ray = ray
        size, cuda = config.world_size, config.device.startswith("cuda") or (
            config.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
        self.placement = placement_group([{"GPU": 1} if cuda else {"CPU": 1}] * size, strategy="PACK")
        try:
            ray.get(self.placement.ready(), timeout=config.distributed_timeout)
        except ray.exceptions.GetTimeoutError:
            raise WorkerError(f"the Ray cluster has no room for {size} rank(s) of {'a GPU' if cuda else 'a CPU'} each "
                              f"within {config.distributed_timeout:.0f} s: {ray.available_resources()}") from None
        host = ray.util.get_node_ip_address()
        listener = multiprocessing.connection.Listener((host, 0), backlog=size, authkey=AUTHKEY)
        actor_class = ray.remote(num_cpus=0 if cuda else 1, num_gpus=1 if cuda else 0)(RankActor)
        self.actors = [actor_class.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            self.placement, placement_group_bundle_index=rank), name=f"hookllm-rank{rank}-{os.getpid()}").remote()
            for rank in range(size)]
        rendezvous = f"tcp://{host}:{free_port()}"
        self.runs = [actor.run.remote(config, rank, listener.address, rendezvous) for rank, actor in enumerate(self.actors)]
        self.conns = accept_ranks(listener, range(size), rank_identity(config), config.distributed_timeout)

    def shutdown(self) -> None:
        """Stop the ranks as the multiprocessing executor does, then their actors and placement."""
        super().shutdown()
        ray = getattr(self, "ray", None)
        if ray is None:
            return
        for actor in getattr(self, "actors", []):
            ray.kill(actor)
        if getattr(self, "placement", None) is not None:
            ray.util.remove_placement_group(self.placement)
            self.placement = None
        self.actors = []

