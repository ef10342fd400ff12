"""Shard owners that search with torch on a GPU, against one process on it (issue 36 §3: each owner
searches its shards with torch on its own GPU where it has one). Run by ``device_check.sh``.

Writes a synthetic index of --nodes in node shards of --shard-nodes (``bench_sharded.write_synthetic``,
the real on-disk format), then on --device: one process's torch backend over the whole index, and
--owners in-process shard owners (``shard_backend.local_owners``; the GPU image has no Ray, and Ray
actors run the same ``ShardOwner``) each holding its shards on the device. Prints one JSON line per
(device, hops): ``equal`` (seeds, seed similarities, |Q*|, chunks and scores bit for bit), both q/s
and their ratio, and ``seeds_equal_cpu`` (the device's seeds and seed similarities against torch on
the CPU for the first --cpu-queries queries: the float64 rescoring is the same bits on both).

    python benchmarks/device_sharded.py --nodes 1000000 --owners 4 --device cuda
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_sharded import index_bytes, queries_of, write_synthetic  # noqa: E402

FIELDS = ("seed_ids", "seed_sims", "n_selected", "chunk_ids", "scores")


def timed(backend, queries: np.ndarray, config):
    """A search of 64 queries to warm up (kernels compiled, copies made), then of all, timed: (result, q/s)."""
    backend.search(queries[:64], config)
    start = time.perf_counter()
    result = backend.search(queries, config)
    return result, len(queries) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1_000_000)
    parser.add_argument("--shard-nodes", type=int, default=250_000)
    parser.add_argument("--owners", type=int, default=4)
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--cpu-queries", type=int, default=500, help="queries also searched on the CPU (0: none)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prefilter", default="auto", help="off, bf16 or auto (bf16 on GPUs from Ampere on)")
    args = parser.parse_args()

    from qcg_gpu.index_format import read_manifest
    from qcg_gpu.retrieval import QCGIndex, RetrievalConfig, Retriever
    from qcg_gpu.retrieval.retriever import local_backend
    from qcg_gpu.retrieval.shard_backend import local_owners

    path = Path(tempfile.mkdtemp(prefix="device_sharded_")) / "index"
    write_synthetic(path, args.nodes, 384, args.shard_nodes, k=10)
    queries, whole = queries_of(path, args.queries), QCGIndex.load(path, verify=False)
    owners = local_owners(path, read_manifest(path), args.owners, local_backend, verify=False)
    for hops in (0, 1, 2):
        config = RetrievalConfig(hops=hops, backend="torch", device=args.device, prefilter=args.prefilter)
        want, one_qps = timed(Retriever(whole, config), queries, config)
        got, sharded_qps = timed(owners, queries, config)
        row = {
            "device": args.device,
            "nodes": args.nodes,
            "shards": len(whole.shards),
            "owners": len(owners.owners),
            "hops": hops,
            "queries": len(queries),
            "mean_selected": round(float(want.n_selected.mean()), 1),
            "equal": all(np.array_equal(getattr(want, f), getattr(got, f)) for f in FIELDS),
            "one_process_queries_per_s": round(one_qps),
            "sharded_queries_per_s": round(sharded_qps),
            "ratio": round(sharded_qps / one_qps, 3),
            "index_bytes": index_bytes(path),
        }
        if args.cpu_queries and hops == 0:
            on_cpu = Retriever(whole, RetrievalConfig(hops=0, backend="torch", device="cpu", prefilter="off"))
            cpu = on_cpu.search(queries[: args.cpu_queries])
            row["seeds_equal_cpu"] = all(
                np.array_equal(getattr(cpu, f), getattr(want, f)[: args.cpu_queries]) for f in FIELDS[:2]
            )
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
