"""Shard-parallel retrieval on a local Ray cluster, against one process (issue 36 §5).

Writes a synthetic index in the real on-disk format (``IndexWriter``, node shards of --shard-nodes):
chunks of 16 nodes, each node its chunk's random unit centre plus noise, and a kNN graph of each
node's next k nodes (a stand-in: its edges are not searched, so ``knn_seconds`` is null). Then, for
each W of --workers, a fresh local Ray cluster of W logical CPUs runs ``qcg query --ray``'s path: a
driver that loads no node array and W shard owners. Printed, one JSON line per (N, W):

* ``equal``: seeds, seed similarities, |Q*|, chunks and scores equal to one process's, bit for bit;
* ``worker_peak_rss_bytes``: the largest VmHWM among the workers, with ``baseline_worker_rss_bytes``
  (a worker that loaded a 2-shard index of 2,000 nodes: Python, numpy, numba, torch) and
  ``goal_bytes`` = index bytes / W x 1.3 + that baseline;
* ``object_store_peak_bytes``: Ray's plasma store, sampled every 0.2 s during the searches;
* ``queries_per_s`` (the measured batch after one warm-up batch) and ``one_process_queries_per_s``
  (the same batch, the whole index in this process, measured in the same run), and their ratio;
* ``bytes_per_query``: array bytes between the driver and the workers per query (queries in,
  seeds, kNN rows, Q* lists and top-K out).

First, rows with ``"part": "knn"``: the exact kNN graph of --knn-nodes synthetic nodes built by a Ray
task per node shard reading the shards' files (what a sharded ``--ray`` build runs), against
``knn.knn_graph`` in one process: ``equal`` (every edge and score) and both times; with
--knn-probes P, the approximate (IVF) graph the same way, and its ``edge_recall`` against the exact
one. ``worker_peak_rss_bytes`` is the largest VmHWM among the Ray worker processes that ran the tasks,
beside ``baseline_worker_rss_bytes`` (the same build of a 2,000-node index) and ``shard_bytes`` (the
largest shard's embeddings), to read the peak in shards (RESULTS.md: two shards and buffers that do not
grow with them). (Exact kNN at 2M nodes is hours on 2 cores: O(N^2).) --nodes 0 runs this part alone.
With --knn-shard-nodes >= --knn-nodes the index is one shard, and the Ray rows are what a build stored
whole runs: tasks over blocks of rows, every node in the object store (``distributed.knn_graph_of_parts``).

    python benchmarks/bench_sharded.py --nodes 2000000 --workers 1 2 4
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

NODES_PER_CHUNK = 16
BLOCK_NODES = NODES_PER_CHUNK * 16384  # nodes generated at a time (a multiple of a chunk's)


def write_synthetic(
    out: Path, n_nodes: int, dim: int, shard_nodes: int | None, k: int, seed: int = 0, exact: bool = False
) -> None:
    """A synthetic index of ``n_nodes`` sentence-style nodes in node shards, written block by block; its
    kNN graph a stand-in of the real shape, or with ``exact`` the exact one (every node in memory)."""
    import pyarrow as pa

    from qcg_gpu.config import IndexConfig
    from qcg_gpu.index_format import ArrayParts, IndexWriter, plan_shards

    n_chunks = -(-n_nodes // NODES_PER_CHUNK)
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n_chunks, dim), dtype=np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    node_chunk = np.arange(n_nodes) // NODES_PER_CHUNK

    def node_blocks():
        for start in range(0, n_nodes, BLOCK_NODES):
            ids = np.arange(start, min(n_nodes, start + BLOCK_NODES))
            block = centres[ids // NODES_PER_CHUNK] + 0.6 / np.sqrt(dim) * np.random.default_rng(
                seed + 1 + start
            ).standard_normal((len(ids), dim), dtype=np.float32)
            yield block / np.linalg.norm(block, axis=1, keepdims=True)

    def node_tables():
        for start in range(0, n_nodes, BLOCK_NODES):
            ids = np.arange(start, min(n_nodes, start + BLOCK_NODES))
            yield pa.table(
                {
                    "node_id": pa.array(ids, pa.int64()),
                    "chunk_id": pa.array(ids // NODES_PER_CHUNK, pa.int64()),
                    "source_index": pa.array(ids % NODES_PER_CHUNK, pa.int64()),
                    "text": pa.array([""] * len(ids), pa.string()),
                }
            )

    chunks = pa.table(
        {
            "chunk_id": pa.array(np.arange(n_chunks), pa.int64()),
            "doc_id": pa.array([f"doc{c}" for c in range(n_chunks)], pa.string()),
            "chunk_index": pa.array(np.zeros(n_chunks, np.int32), pa.int32()),
            "n_tokens": pa.array(np.zeros(n_chunks, np.int32), pa.int32()),
            "text": pa.array([""] * n_chunks, pa.string()),
            "n_pairs": pa.array(np.zeros(n_chunks, np.int32), pa.int32()),
            "n_kept": pa.array(np.zeros(n_chunks, np.int32), pa.int32()),
        }
    )
    pairs = pa.table(
        {
            "chunk_id": pa.array([], pa.int64()),
            "gen_index": pa.array([], pa.int32()),
            "question": pa.array([], pa.string()),
            "answer": pa.array([], pa.string()),
            "score": pa.array([], pa.float32()),
            "kept": pa.array([], pa.bool_()),
        }
    )
    if exact:
        from qcg_gpu.indexing.knn import knn_graph

        graph = knn_graph(np.concatenate(list(node_blocks())), k)
        indptr, indices, scores = graph.indptr, graph.indices, graph.scores
    else:  # each node's next k nodes (mod N): a stand-in graph of the real shape, k edges per row
        indptr = np.arange(n_nodes + 1, dtype=np.int64) * k
        indices = ((np.arange(n_nodes)[:, None] + np.arange(1, k + 1)[None, :]) % n_nodes).reshape(-1)
        scores = np.tile(np.linspace(0.9, 0.8, k, dtype=np.float32), n_nodes)
    config = IndexConfig()
    config.nodes.nodes, config.graph.knn_k, config.graph.shard_nodes = "sentence", k, shard_nodes
    writer = IndexWriter(out, plan_shards(node_chunk, n_chunks, shard_nodes))
    writer.write_table("nodes", node_tables())
    writer.write_table("chunks", chunks)
    writer.write_table("pairs", pairs)
    writer.write_array("node_embeddings", ArrayParts((n_nodes, dim), np.dtype(np.float32), node_blocks()))
    writer.write_array("chunk_embeddings", centres)
    writer.write_array("pair_embeddings", np.zeros((0, dim), np.float32))
    writer.write_graph(indptr, indices, scores)
    counts = {"documents": n_chunks, "chunks": n_chunks, "pairs_valid": 0, "pairs_kept": 0, "nodes": n_nodes}
    models = {"llm": None, "embedder": "synthetic", "embedding_dim": dim}
    writer.commit({"settings": config.to_dict(), "models": models, "counts": {**counts, "knn_edges": len(indices)}})


def queries_of(index_path: Path, count: int, seed: int = 1) -> np.ndarray:
    """Queries near random nodes (so that each has seeds above the threshold), unit rows."""
    from qcg_gpu.index_format import index_shards, load_shard_array, read_manifest

    manifest = read_manifest(index_path)
    shard = index_shards(manifest)[0]
    nodes = load_shard_array(index_path, manifest, shard, "node_embeddings", verify=False)
    rng = np.random.default_rng(seed)
    q = nodes[rng.choice(len(nodes), count)] + 0.3 / np.sqrt(nodes.shape[1]) * rng.standard_normal(
        (count, nodes.shape[1]), dtype=np.float32
    )
    return np.ascontiguousarray(q / np.linalg.norm(q, axis=1, keepdims=True), np.float32)


def cpu_name() -> str:
    with open("/proc/cpuinfo") as fh:
        return next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "unknown")


def index_bytes(path: Path) -> int:
    from qcg_gpu.index_format import data_dir

    return sum(p.stat().st_size for p in data_dir(path).rglob("*") if p.is_file())


class PlasmaPeak:
    """The peak of Ray's object store usage, sampled every 0.2 s (ray's memory summary; None if unreadable)."""

    def __init__(self):
        self.peak, self._stop = None, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from ray._private.internal_api import memory_summary

        while not self._stop.is_set():
            try:
                text = memory_summary(stats_only=True)
                match = re.search(r"Plasma memory usage (\d+) MiB", text)
                if match:
                    self.peak = max(self.peak or 0, int(match.group(1)) << 20)
            except Exception:  # the summary is best effort: its absence leaves the peak None
                return
            self._stop.wait(0.2)

    def __enter__(self) -> PlasmaPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def on_ray(path: Path, workers: int, queries: np.ndarray, config) -> dict:
    """One run of W shard owners: its peaks, its speed and its results."""
    import ray

    from qcg_gpu.cluster import RayCluster
    from qcg_gpu.config import RayConfig
    from qcg_gpu.retrieval import QCGIndex, Retriever

    ray.init(num_cpus=workers, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        cluster = RayCluster(RayConfig(ray=True, ray_workers=workers))
        driver = QCGIndex.load(path, verify=False, nodes=False)
        with PlasmaPeak() as plasma:
            start = time.perf_counter()
            retriever = Retriever(driver, config, cluster)
            load_s = time.perf_counter() - start
            retriever.search(queries[:64])  # warm-up: kernels compiled, prefilter copies made
            retriever.backend.bytes_moved = 0
            start = time.perf_counter()
            result = retriever.search(queries)
            search_s = time.perf_counter() - start
        peaks = ray.get([actor.peak_rss.remote() for actor in cluster._actors])
        return {
            "result": result,
            "load_seconds": round(load_s, 2),
            "search_seconds": search_s,
            "worker_peak_rss_bytes": max(peaks),
            "object_store_peak_bytes": plasma.peak,
            "bytes_per_query": round(retriever.backend.bytes_moved / len(queries)),
        }
    finally:
        ray.shutdown()


def ray_worker_peaks() -> list[int]:
    """VmHWM in bytes of every Ray worker process of this machine (their command lines start "ray::")."""
    peaks = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if not (proc / "cmdline").read_bytes().startswith(b"ray::"):
                continue
            status = (proc / "status").read_text()
        except OSError:  # ended meanwhile
            continue
        peaks += [int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")]
    return peaks


def sharded_knn(path: Path, emb: np.ndarray, shard_nodes: int, workers: int, k: int, probes):
    """The sharded kNN build of ``emb`` on a fresh local cluster of ``workers`` CPUs: (seconds, the
    shards' indices and scores, the largest worker VmHWM, the shard count)."""
    import ray

    from qcg_gpu.cluster import RayCluster
    from qcg_gpu.config import RayConfig
    from qcg_gpu.index_format import IndexWriter, plan_shards
    from qcg_gpu.indexing.distributed import knn_graph_of_parts, knn_of_shards

    node_chunk = np.arange(len(emb)) // NODES_PER_CHUNK
    writer = IndexWriter(path, plan_shards(node_chunk, int(node_chunk[-1]) + 1, shard_nodes))
    writer.write_array("node_embeddings", emb)
    whole = writer.shards is None  # an index stored whole: Ray tasks over blocks of rows, all nodes shared
    ray.init(num_cpus=workers, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        cluster = RayCluster(RayConfig(ray=True, ray_workers=workers))
        start = time.perf_counter()
        if whole:
            graph = knn_graph_of_parts(cluster, [ray.put(emb)], len(emb), k, "auto", None, probes)
        else:
            knn_of_shards(cluster, writer, k, "auto", None, probes)
        seconds = time.perf_counter() - start
        peak = max(ray_worker_peaks())
    finally:
        ray.shutdown()
    if whole:
        got, scores = graph.indices, graph.scores
    else:
        got = np.concatenate([np.load(writer.data / s.file("knn_indices.npy")) for s in writer.shards])
        scores = np.concatenate([np.load(writer.data / s.file("knn_scores.npy")) for s in writer.shards])
    writer.abort()
    return seconds, got, scores, peak, 1 if whole else len(writer.shards)


def knn_rows(root: Path, n: int, dim: int, shard_nodes: int, workers_list: list[int], k: int, probes) -> None:
    """The kNN graph of ``n`` synthetic nodes in shards, exact and (``probes``) approximate: one process
    (``knn.knn_graph``) against a Ray task per shard reading the shards' files (``distributed.knn_of_shards``),
    W workers each; the approximate graph's edge recall against the exact one."""
    from qcg_gpu.index_format import load_array
    from qcg_gpu.indexing.knn import knn_graph

    path = root / f"knn{n}"
    write_synthetic(path, n, dim, shard_nodes, k)
    emb = np.asarray(load_array(path, "node_embeddings"))
    exact = None
    for mode_probes in [None] + ([probes] if probes else []):
        baseline = sharded_knn(root / "knn-baseline", emb[:2000], 1000, 1, k, mode_probes)[3]
        start = time.perf_counter()
        want = knn_graph(emb, k, probes=mode_probes)
        one_s = time.perf_counter() - start
        exact = exact or want
        for workers in workers_list:
            seconds, got, scores, peak, shards = sharded_knn(
                root / f"knn{n}-w{workers}", emb, shard_nodes, workers, k, mode_probes
            )
            equal = np.array_equal(got, want.indices) and np.array_equal(scores, want.scores)
            row = {"part": "knn", "knn": "exact" if mode_probes is None else "approximate", "probes": mode_probes}
            row |= {"nodes": n, "workers": workers, "shards": shards, "equal": bool(equal)}
            row |= {"knn_seconds": round(seconds, 1), "one_process_knn_seconds": round(one_s, 1)}
            row |= {"worker_peak_rss_bytes": peak, "baseline_worker_rss_bytes": baseline}
            row |= {"shard_bytes": shard_nodes * dim * 4}
            if mode_probes is not None:
                found = (got.reshape(n, -1)[:, :, None] == exact.indices.reshape(n, -1)[:, None, :]).any(2)
                row["edge_recall"] = round(float(found.mean()), 4)
            print(json.dumps(row | {"cpu": cpu_name()}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2_000_000])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--shard-nodes", type=int, default=250_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--k", type=int, default=10, help="kNN edges per node")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--hops", type=int, default=1)
    parser.add_argument(
        "--prefilter",
        default="off",
        choices=("auto", "bf16", "int8", "off"),
        help="the seed GEMM's precision, in the owners and in one process (off: float32, this table's history)",
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="where to write the indexes (a folder removed at the end; default: the temp dir)",
    )
    parser.add_argument("--knn-nodes", type=int, default=50_000, help="nodes of the exact kNN part (0: skip it)")
    parser.add_argument("--knn-shard-nodes", type=int, default=10_000)
    parser.add_argument("--knn-probes", type=int, default=None, help="also the approximate graph, these lists a node")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_sharded_", dir=args.root) as root:  # GBs of indexes
        run(args, Path(root))


def run(args: argparse.Namespace, root: Path) -> None:
    from qcg_gpu.retrieval import QCGIndex, RetrievalConfig, Retriever

    config = RetrievalConfig(hops=args.hops, prefilter=args.prefilter)
    if args.knn_nodes:
        knn_rows(root, args.knn_nodes, args.dim, args.knn_shard_nodes, args.workers, args.k, args.knn_probes)
    if not any(args.nodes):
        return
    tiny = root / "tiny"
    write_synthetic(tiny, 2000, args.dim, 1000, args.k)
    baseline = {w: on_ray(tiny, w, queries_of(tiny, 64), config)["worker_peak_rss_bytes"] for w in args.workers}
    for n in [n for n in args.nodes if n]:
        path = root / f"n{n}"
        start = time.perf_counter()
        write_synthetic(path, n, args.dim, args.shard_nodes, args.k)
        write_s = time.perf_counter() - start
        size, queries = index_bytes(path), queries_of(path, args.queries)
        one = Retriever(QCGIndex.load(path, verify=False), config)
        one.search(queries[:64])
        start = time.perf_counter()
        want = one.search(queries)
        one_qps = len(queries) / (time.perf_counter() - start)
        del one
        for workers in args.workers:
            run = on_ray(path, workers, queries, config)
            got = run.pop("result")
            equal = all(
                np.array_equal(getattr(want, f), getattr(got, f))
                for f in ("seed_ids", "seed_sims", "n_selected", "chunk_ids", "scores")
            )
            qps = len(queries) / run.pop("search_seconds")
            goal = size / workers * 1.3 + baseline[workers]
            row = {
                "nodes": n,
                "workers": workers,
                "shards": -(-n // args.shard_nodes),
                "equal": equal,
                **run,
                "baseline_worker_rss_bytes": baseline[workers],
                "goal_bytes": round(goal),
                "within_goal": run["worker_peak_rss_bytes"] <= goal,
                "index_bytes": size,
                "knn_seconds": None,
                "write_seconds": round(write_s, 1),
                "queries": len(queries),
                "queries_per_s": round(qps, 1),
                "one_process_queries_per_s": round(one_qps, 1),
                "prefilter": args.prefilter,
                "ratio_to_one_process": round(qps / one_qps, 3),
                "cpu": cpu_name(),
            }
            print(json.dumps(row), flush=True)
        shutil.rmtree(path)  # one index on disk at a time


if __name__ == "__main__":
    main()
