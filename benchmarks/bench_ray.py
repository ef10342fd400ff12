"""The Ray path's overhead against one process, side by side in one run on this machine.

    python benchmarks/bench_ray.py                # ~10 min on 2 CPU cores
    python benchmarks/bench_ray.py --limit 0 --llm-limit 24 --queries 10000 --nodes 100000

Each measurement runs once in one process and once on a local Ray cluster (``--workers``):

1. ``qcg index`` with sentence nodes (no LLM: embedding and kNN) over ``--limit`` documents, on Ray in
   the default shards (one, below 8,192 chunks, cut in one per worker to embed) and in ``--shard-chunks`` chunks;
2. ``qcg index`` with q+a nodes over ``--llm-limit`` documents, fresh caches (each generates every chunk),
   on Ray both with qcg's engine actors and with ray.data.llm's processor (``--ray-llm actors|data``),
   greedy decoding (``--temperature 0``) so that both runs write about the same replies: with sampling,
   one reply that runs on to ``max_tokens`` in one run and not in the other decides the comparison;
3. retrieval of ``--queries`` queries over ``bench_retrieval.py``'s synthetic index of ``--nodes`` nodes,
   in this process.

Builds run as the commands a user types, in fresh processes, so the Ray rows include starting the
cluster and its workers. Both builds must write the same index (checked: data files byte for byte).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_retrieval import make_queries, synthetic_index  # this folder: the retrieval benchmark's index and queries

from qcg_gpu.capabilities import cpu_kind
from qcg_gpu.index_format import read_manifest
from qcg_gpu.retrieval import RetrievalConfig, Retriever

DEFAULT_DOCS = Path(__file__).resolve().parents[2] / "shared" / "data" / "lihuaworld" / "docs"


def copy_docs(source: Path, target: Path, limit: int) -> Path:
    target.mkdir(parents=True)
    for path in sorted(source.rglob("*.txt"))[: limit or None]:
        (target / f"{path.parent.name}_{path.name}").write_text(path.read_text())
    return target


def timed_build(docs: Path, out: Path, options: list[str]) -> dict:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "qcg_gpu.cli", "index", str(docs), str(out), "--quiet", *options],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"qcg index {' '.join(options)} failed:\n{done.stderr[-3000:]}")
    manifest = read_manifest(out)
    row = {
        "wall_s": round(wall, 2),
        "stages_s": {k: round(v, 2) for k, v in manifest["stage_seconds"].items()},
        "chunks": manifest["counts"]["chunks"],
        "nodes": manifest["counts"]["nodes"],
    }
    generated = manifest["llm_tokens"]["generated_output_this_run"]
    if generated:
        row |= {
            "output_tokens": generated,
            "output_tok_per_s": round(generated / manifest["stage_seconds"]["generate"], 1),
        }
    return row


def same_data(a: Path, b: Path) -> bool:
    da, db = a / read_manifest(a)["data_dir"], b / read_manifest(b)["data_dir"]
    names = sorted(p.name for p in da.iterdir())
    return names == sorted(p.name for p in db.iterdir()) and all(
        (da / n).read_bytes() == (db / n).read_bytes() for n in names
    )


def compare_builds(name: str, docs: Path, work: Path, options: list[str], workers: int, variants=None) -> dict:
    """One process against each Ray variant (label -> extra options; default: plain ``--ray``)."""
    one = timed_build(docs, work / f"{name}-one", options + ["--cache", str(work / f"{name}-one.sqlite")])
    row: dict = {"what": f"build, {name}", "one_process": one}
    for label, extra in (variants or {"ray": []}).items():
        ray = timed_build(
            docs,
            work / f"{name}-{label}",
            options + ["--cache", str(work / f"{name}-{label}.sqlite"), "--ray", "--ray-workers", str(workers), *extra],
        )
        row[label], row[f"{label}_over_one"] = ray, round(ray["wall_s"] / one["wall_s"], 2)
    if name == "sentence":  # no LLM: the same index expected byte for byte
        row["identical"] = all(
            same_data(work / f"{name}-one", work / f"{name}-{label}") for label in variants or ["ray"]
        )
    return row


def compare_retrieval(n: int, b: int, workers: int) -> dict:
    from qcg_gpu.cluster import RayCluster
    from qcg_gpu.config import RayConfig

    index, config = synthetic_index(n), RetrievalConfig(backend="numpy")
    q = make_queries(index, b)
    start = time.perf_counter()
    retriever = Retriever(index, config)
    retriever.search(q)
    one_first = time.perf_counter() - start  # with the backend's set-up (bf16 copy, kernels loaded)
    start = time.perf_counter()
    want = retriever.search(q)
    one = time.perf_counter() - start
    start = time.perf_counter()
    cluster = RayCluster(RayConfig(ray=True, ray_workers=workers))
    connect = time.perf_counter() - start
    on_ray = Retriever(index, config, cluster)
    times = []
    for _ in range(2):  # the first call also ships the index and sets the workers up
        start = time.perf_counter()
        got = on_ray.search(q)
        times.append(time.perf_counter() - start)
    same = all(np.array_equal(getattr(got, f), getattr(want, f)) for f in ("chunk_ids", "scores", "seed_ids"))
    return {
        "what": f"retrieval, N={n}, B={b}",
        "one_process_first_call_s": round(one_first, 2),
        "one_process_next_call_s": round(one, 2),
        "ray_connect_s": round(connect, 2),
        "ray_first_call_s": round(times[0], 2),
        "ray_next_call_s": round(times[1], 2),
        "ray_over_one": round(times[1] / one, 2),
        "identical": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=Path, default=DEFAULT_DOCS)
    parser.add_argument("--limit", type=int, default=120, help="documents for the sentence-node build (0 = all)")
    parser.add_argument("--llm-limit", type=int, default=8, help="documents for the q+a build with the LLM")
    parser.add_argument("--shard-chunks", type=int, default=32, help="the sentence build's smaller Ray shards")
    parser.add_argument("--m", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=100_000, help="nodes of the synthetic retrieval index")
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--parts", default="sentence,llm,retrieval", help="which measurements to run")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "bench_ray.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qcg-bench-ray-") as work:  # the copied documents and the indexes
        run(args, Path(work))


def run(args: argparse.Namespace, work: Path) -> None:
    parts = args.parts.split(",")

    common = ["--device", "cpu"]
    rows = []
    if "sentence" in parts:
        rows.append(
            compare_builds(
                "sentence",
                copy_docs(args.docs, work / "docs", args.limit),
                work,
                common + ["--nodes", "sentence"],
                args.workers,
                # the default shards (8,192 chunks: one here, cut for the embedding), and smaller ones
                {"ray": [], "ray_small_shards": ["--ray-shard-chunks", str(args.shard_chunks)]},
            )
        )
        print(json.dumps(rows[-1]), flush=True)
    if "llm" in parts:
        rows.append(
            compare_builds(
                "q+a",
                copy_docs(args.docs, work / "llm-docs", args.llm_limit),
                work,
                common + ["--m", str(args.m), "--temperature", "0"],
                args.workers,
                # qcg's engine actors and ray.data.llm's processor (the GPU cluster default), side by side
                {"ray": ["--ray-llm", "actors"], "ray_data_llm": ["--ray-llm", "data"]},
            )
        )
        print(json.dumps(rows[-1]), flush=True)
    if "retrieval" in parts:
        rows.append(compare_retrieval(args.nodes, args.queries, args.workers))
        print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": cpu_kind(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
