"""Updates of an index stored in node shards, against the same updates of it stored whole (issue 36 §4).

Writes one synthetic index twice (``bench_sharded.write_synthetic``: chunks of 16 nodes around random
centres, a document a chunk), in shards of --shard-nodes and whole. Then, in a fresh process each:

1. add: --added nodes (new chunks, new centres), through what ``qcg index add`` runs once the new texts
   are embedded (``incremental.publish_added``): the sharded index keeps its shards' files and grows
   their kNN rows shard by shard; the whole one is loaded;
2. remove: the first --removed documents (``qcg index remove``; every id after them moves): the sharded
   index is rewritten shard by shard, the whole one loaded; with --ray-workers W, a third copy of the
   sharded index is updated with a local Ray cluster of W workers (``qcg index remove --ray``: a task
   per shard for its kNN rows), its line's ``worker_peak_rss_bytes`` the largest Ray worker's VmHWM.

Printed, one JSON line per (N, update, layout):

* ``peak_rss_bytes``: the updating process's VmHWM, beside ``baseline_rss_bytes`` (the same update of
  a sharded index of 4,000 nodes: 1,600 nodes added, then 100 documents removed) and
  ``shard_bytes`` (one shard's node embeddings);
* ``seconds``: the update (the kNN rows and the new version written);
* ``equal`` (the "shards" line): every kNN edge and score after the update equal to the whole index's;
  and, where N <= --exact-upto, both equal to the exact graph of every node (the index is written with
  its exact graph then; above, with a stand-in of the real shape, so memory and time are measured).

    python benchmarks/bench_sharded_updates.py --nodes 20000 2000000 --shard-nodes 250000
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_sharded import NODES_PER_CHUNK, cpu_name, ray_worker_peaks, write_synthetic

BASELINE = (("add", 1600), ("remove", 100))  # the updates of a 4,000-node index that give the baselines


def new_nodes(n_nodes: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Chunk centres and their nodes (16 a chunk, the centre plus noise), unit rows, as write_synthetic makes."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n_nodes // NODES_PER_CHUNK, dim), dtype=np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    nodes = np.repeat(centres, NODES_PER_CHUNK, axis=0)
    nodes += 0.6 / np.sqrt(dim) * rng.standard_normal(nodes.shape, dtype=np.float32)
    return centres, nodes / np.linalg.norm(nodes, axis=1, keepdims=True)


def add(path: Path, n_added: int, seed: int = 7) -> dict:
    """Add ``n_added`` synthetic nodes to the index at ``path`` in this process: seconds and VmHWM."""
    from qcg_gpu.index_format import load_table, read_manifest
    from qcg_gpu.indexing.chunking import Chunk
    from qcg_gpu.indexing.incremental import Additions, index_settings, publish_added
    from qcg_gpu.indexing.nodes import Nodes
    from qcg_gpu.indexing.stages import Embedded, IndexSummary, Pairs

    manifest = read_manifest(path)
    dim = manifest["models"]["embedding_dim"]
    centres, node_emb = new_nodes(n_added, dim, seed)
    chunks = [Chunk(f"added{seed}-{c}", 0, 0, "") for c in range(len(centres))]
    pairs = Pairs.empty()
    pairs.score, pairs.kept = np.zeros(0, np.float32), np.zeros(0, bool)
    ids = np.arange(len(node_emb))
    nodes = Nodes(ids // NODES_PER_CHUNK, ids % NODES_PER_CHUNK, [""] * len(ids), from_pairs=False)
    embedded = Embedded(centres, np.zeros((0, dim), np.float32), nodes, node_emb)
    config, summary = index_settings(manifest, None), IndexSummary(out=path)
    start = time.perf_counter()
    doc_ids = load_table(path, "chunks", manifest, columns=["doc_id"])
    publish_added(path, manifest, doc_ids, Additions(chunks, pairs, embedded), config, summary, {"op": "add"})
    return {"seconds": round(time.perf_counter() - start, 2), "peak_rss_bytes": peak_rss()}


def remove(path: Path, n_removed: int, workers: int = 0) -> dict:
    """Remove the first ``n_removed`` documents of the index at ``path`` in this process (with a local Ray
    cluster of ``workers`` for the kNN rows, if any): seconds and VmHWM, the Ray workers' largest too."""
    from qcg_gpu.indexing.incremental import remove_documents

    cluster = None
    if workers:
        import ray

        from qcg_gpu.cluster import RayCluster
        from qcg_gpu.config import RayConfig

        ray.init(num_cpus=workers, include_dashboard=False, configure_logging=False, log_to_driver=False)
        cluster = RayCluster(RayConfig(ray=True, ray_workers=workers))
    start = time.perf_counter()
    remove_documents(path, [f"doc{c}" for c in range(n_removed)], cluster=cluster)
    row = {"seconds": round(time.perf_counter() - start, 2), "peak_rss_bytes": peak_rss()}
    if cluster is not None:
        row |= {"workers": workers, "worker_peak_rss_bytes": max(ray_worker_peaks(), default=None)}
        cluster.ray.shutdown()
    return row


def peak_rss() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))


def in_child(update: str, path: Path, count: int, workers: int = 0) -> dict:
    """``update`` (add or remove) of ``count`` nodes or documents, in a fresh process (on Ray with ``workers``)."""
    run = subprocess.run(
        [sys.executable, __file__, "--child", update, str(path), str(count), str(workers)],
        capture_output=True,
        text=True,
        check=False,
    )
    if run.returncode:
        raise SystemExit(f"the {update} of {path} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def graph_of(path: Path) -> tuple[np.ndarray, np.ndarray]:
    from qcg_gpu.index_format import load_array

    return np.asarray(load_array(path, "knn_indices")), np.asarray(load_array(path, "knn_scores"))


def exact_graph(path: Path, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The exact kNN graph of every node of the index at ``path``, in this process."""
    from qcg_gpu.index_format import load_array
    from qcg_gpu.indexing.knn import knn_graph

    graph = knn_graph(np.asarray(load_array(path, "node_embeddings")), k)
    return graph.indices, graph.scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[20_000, 2_000_000])
    parser.add_argument("--shard-nodes", type=int, default=250_000)
    parser.add_argument("--added", type=int, default=20_000, help="nodes added (a multiple of 16)")
    parser.add_argument("--removed", type=int, default=1000, help="documents removed (16 nodes each)")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--k", type=int, default=10, help="kNN edges per node")
    parser.add_argument("--exact-upto", type=int, default=50_000, help="indexes this small get their exact graph")
    parser.add_argument("--root", type=Path, default=None, help="where the indexes are written (default: a temp dir)")
    parser.add_argument("--updates", nargs="+", choices=["add", "remove"], default=["add", "remove"])
    parser.add_argument("--ray-workers", type=int, default=0, help="also remove with a local Ray cluster of W workers")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        update, path, count, workers = args.child
        done = add(Path(path), int(count)) if update == "add" else remove(Path(path), int(count), int(workers))
        print(json.dumps(done))
        return

    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        root = Path(tmp)
        write_synthetic(root / "baseline", 4000, args.dim, 2000, args.k)
        baseline = {update: in_child(update, root / "baseline", count)["peak_rss_bytes"] for update, count in BASELINE}
        for n in args.nodes:
            exact, shard_nodes = n <= args.exact_upto, min(args.shard_nodes, n // 2)
            paths = {"whole": root / f"whole{n}", "shards": root / f"shards{n}"}
            for layout, path in paths.items():
                write_synthetic(path, n, args.dim, shard_nodes if layout == "shards" else None, args.k, exact=exact)
            if args.ray_workers and "remove" in args.updates:
                paths["shards-ray"] = root / f"ray{n}"
                shutil.copytree(paths["shards"], paths["shards-ray"])
            counts = {"add": args.added, "remove": args.removed}
            for update, count in ((update, counts[update]) for update in args.updates):
                for layout, path in paths.items():
                    if layout == "shards-ray" and update != "remove":
                        continue
                    row = {"nodes": n, "update": update, "count": count, "layout": layout}
                    row |= in_child(update, path, count, args.ray_workers if layout == "shards-ray" else 0)
                    if layout.startswith("shards"):
                        got, want = graph_of(path), graph_of(paths["whole"])
                        same = all(np.array_equal(a, b) for a, b in zip(got, want))
                        if exact:
                            same = same and all(np.array_equal(a, b) for a, b in zip(got, exact_graph(path, args.k)))
                        row |= {
                            "equal": bool(same),
                            "shard_nodes": shard_nodes,
                            "shard_bytes": shard_nodes * args.dim * 4,
                        }
                    row |= {"baseline_rss_bytes": baseline[update], "exact_graph": exact, "cpu": cpu_name()}
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
