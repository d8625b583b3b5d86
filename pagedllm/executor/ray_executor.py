"""The ``ray`` executor: one Ray actor per rank, placed by a placement group across a Ray cluster's nodes.

``ray.init()`` joins the cluster ``ray start`` began on this node (or ``RAY_ADDRESS``), or
starts a local one; an application that already called ``ray.init`` keeps its own. Each rank
asks for one CPU (one GPU on CUDA) as its own bundle, packed onto as few nodes as fit; rank 0's
node hosts the torch.distributed rendezvous at a port its OS picked. Every node needs this
Python environment (pagedllm and the model files at the same path).
"""

from __future__ import annotations

import logging
import os
from collections import deque
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.distributed import get_open_port
from pagedllm.errors import InvalidParameterError
from pagedllm.executor.base import DistributedExecutor
from pagedllm.worker.runner_output import ModelRunnerOutput

logger = logging.getLogger("pagedllm")

PLACEMENT_TIMEOUT_S = 60.0


class RayWorker:
    """The actor around a Worker (built once the rendezvous address is known)."""

    def __init__(self) -> None:
        self.worker: Any = None

    def node(self) -> tuple[str, str, int]:
        """(node id, node IP, usable cores) of the node this actor landed on."""
        import ray

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), cores

    def open_port(self) -> int:
        return get_open_port("0.0.0.0")

    def start(self, config: EngineConfig, rank: int, init_method: str, num_threads: int) -> None:
        from pagedllm.worker.worker import Worker

        self.worker = Worker(config, rank, init_method, num_threads)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)


class RayExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig):
        try:
            import ray
        except ImportError:
            raise InvalidParameterError(
                "distributed_executor_backend='ray' needs Ray: pip install 'pagedllm[ray]'",
                "distributed_executor_backend",
            ) from None
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        super().__init__(config)
        self._ray = ray
        pc = config.parallel_config
        self._pending: deque[list[Any]] = deque()  # the calls of each step in flight
        if not ray.is_initialized():
            # Ray runs its workers at nice 15, which a busy machine's other processes starve: ours are the
            # engine's arithmetic (a cluster this starts here; `ray start` takes the same variable)
            os.environ.setdefault("RAY_worker_niceness", "0")
            ray.init(address=os.environ.get("RAY_ADDRESS"), logging_level=logging.WARNING)
        use_gpu = config.model_config.device == "cuda" or (
            config.model_config.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0
        )
        # inside a Ray Serve replica with a bundle per rank after its own (pagedllm.serve_ray): place them there,
        # with what those bundles hold
        current = ray.util.get_current_placement_group()
        first = 1 if current is not None and len(current.bundle_specs) > self.world_size else None
        if first is not None:
            assert current is not None
            use_gpu = all(b.get("GPU", 0) >= 1 for b in current.bundle_specs[1 : 1 + self.world_size])
        bundle = {"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": 1.0}
        have = ray.available_resources() if first is None else dict.fromkeys(bundle, float("inf"))
        for key, amount in bundle.items():
            if have.get(key, 0.0) < amount * self.world_size:
                raise InvalidParameterError(
                    f"the Ray cluster cannot place {self.world_size} workers (tensor_parallel_size x "
                    f"pipeline_parallel_size): they need {amount * self.world_size:g} {key}, one per worker, and the "
                    f"cluster has {have.get(key, 0.0):g} {key} available ({ray.cluster_resources().get(key, 0.0):g} "
                    "in all)",
                    "tensor_parallel_size",
                )
        ready: list[Any] = [True]
        if first is not None:
            assert current is not None
            self._pg: Any = current
            self._own_pg = False  # (its owner, Serve, removes it)
        else:
            first, self._own_pg = 0, True
            self._pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
            ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(self._pg)
            raise InvalidParameterError(
                f"the Ray cluster could not place {self.world_size} bundles of {bundle} within "
                f"{PLACEMENT_TIMEOUT_S:g} s (available: {ray.available_resources()})",
                "tensor_parallel_size",
            )
        self._remove_pg = remove_placement_group
        actor_cls = ray.remote(RayWorker)
        # Ray's ActorHandle exposes the methods as dynamic proxies (.remote) its stubs cannot express
        self.actors: list[Any] = [
            actor_cls.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=first + rank
                ),
            ).remote()
            for rank in range(self.world_size)
        ]
        self.nodes = self._get([a.node.remote() for a in self.actors])
        port = self._get([self.actors[0].open_port.remote()])[0]
        init_method = f"tcp://{self.nodes[0][1]}:{port}"
        per_node = {node_id: sum(n[0] == node_id for n in self.nodes) for node_id, _, _ in self.nodes}
        self._get(
            [
                a.start.remote(config, rank, init_method, max(1, cores // per_node[node_id]))
                for rank, (a, (node_id, _, cores)) in enumerate(zip(self.actors, self.nodes))
            ]
        )
        logger.info(
            "started %d Ray workers on %d node(s) (tp=%d, pp=%d)",
            self.world_size,
            len(per_node),
            pc.tensor_parallel_size,
            pc.pipeline_parallel_size,
        )

    def _get(self, refs: list[Any]) -> list[Any]:
        """Wait for every call; the first failure (a raised error, a dead actor) stops all and raises."""
        ray = self._ray
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as e:
                    cause = getattr(e, "cause", None)
                    self._fail(f"a Ray worker failed: {e}", cause if isinstance(cause, BaseException) else e)
        return ray.get(refs)

    def _call_all(self, method: str, args: tuple) -> list[Any]:
        return self._get([a.call.remote(method, *args) for a in self.actors])

    def _send_step(self, so: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        ref = self._ray.put(so)
        self._pending.append(
            [
                a.call.remote("execute_model", ref, None if rank == self.driver else sampled)
                for rank, a in enumerate(self.actors)
            ]
        )

    def _receive_step(self) -> ModelRunnerOutput:
        return self._get(self._pending.popleft())[self.driver]  # each actor runs its calls in order

    def _stop_workers(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        for a in getattr(self, "actors", []):
            try:
                self._ray.kill(a)
            except Exception:
                pass
        self.actors = []
        if getattr(self, "_pg", None) is not None and getattr(self, "_own_pg", True):
            try:
                self._remove_pg(self._pg)
            except Exception:
                pass
            self._pg = None
