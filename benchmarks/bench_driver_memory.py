"""Peak memory of the process that builds an index, against corpus size (issue 16 §2).

For each corpus size N: N synthetic one-chunk documents (JSONL) and a stored generation with a
reply of --pairs pairs for every chunk (``--replies-in``: the replies are replayed, no LLM runs).
Each build runs in a fresh process, and its peak resident memory is read there: VmHWM, and the
peaks of its private (RssAnon) and shared (RssShmem: Ray's object store) parts, sampled:

* ``one``: the one-process build, which holds the corpus (texts, pairs, every embedding);
* ``ray``: the sharded Ray build on a local cluster of --workers workers; only the driver's peak
  counts (Ray's workers, raylet and object store are other processes).

Both builds embed for real, so the time goes into embedding 1 + pairs texts per chunk (each
under 16 word pieces, to keep 100k chunks within minutes on 2 cores).

    python benchmarks/bench_driver_memory.py --chunks 10000 100000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

NAMES = ("LiHua", "Adam", "Yuriko", "Jennifer", "Wolfgang", "Chae", "Mina", "Oskar")
PLACES = ("gym", "cafe", "cinema", "bakery", "concert", "library", "park", "station")
TOPICS = ("the rent", "a birthday", "the exam", "a new job", "the trip", "the garden", "a recipe", "the match")


def document(i: int) -> str:
    """A short note, different for every i (under 16 word pieces: the embedder's cheapest shape)."""
    a, b, c = i % 8, (i // 8) % 8, (i // 64) % 8
    return f"{NAMES[a]}, {PLACES[b]}, {TOPICS[c]}, #{i}"


def reply(i: int, pairs: int) -> str:
    """A Doc2Query reply with ``pairs`` pairs about document i."""
    a, b = i % 8, (i // 8) % 8
    items = [{"question": f"Where was {NAMES[a]} at #{i}?", "answer": f"the {PLACES[b]} ({k})"} for k in range(pairs)]
    return json.dumps({"pairs": items})


def write_inputs(root: Path, n: int, pairs: int) -> tuple[Path, Path]:
    """The corpus and its stored generation, under the settings :func:`config` builds with."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from qcg_gpu.indexing import doc2query
    from qcg_gpu.indexing.documents import SkipLog
    from qcg_gpu.indexing.generation import reply_settings
    from qcg_gpu.indexing.stages import IndexSummary, iter_chunks
    from qcg_gpu.llm.backends import llm_name
    from qcg_gpu.llm.cache import SETTINGS_KEY

    docs, replies = root / "docs.jsonl", root / "replies.parquet"
    with open(docs, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"doc_id": f"d{i}", "text": document(i)}) + "\n")
    cfg, keys, values = config(root, pairs), [], []
    model = llm_name(cfg.generation)
    for i, chunk in enumerate(iter_chunks(docs, cfg, IndexSummary(out=root), SkipLog())):
        keys.append(doc2query.cache_key(chunk.text, model, cfg.generation))
        values.append(json.dumps({"text": reply(i, pairs), "prompt_tokens": 0, "output_tokens": 0}))
    settings = json.dumps(reply_settings(cfg, model), sort_keys=True)
    table = pa.table({"key": keys, "value": values}).replace_schema_metadata({SETTINGS_KEY: settings})
    pq.write_table(table, replies)
    return docs, replies


def config(root: Path, pairs: int):
    from qcg_gpu.config import IndexConfig

    cfg = IndexConfig()
    cfg.generation.m = pairs
    cfg.generation.cache = str(root / "cache.sqlite")
    cfg.generation.replies_in = str(root / "replies.parquet")
    cfg.nodes.device = "cpu"
    return cfg


def status_mb() -> dict[str, float]:
    """This process's memory counters from /proc/self/status, MB."""
    fields = ("VmHWM", "VmRSS", "RssAnon", "RssShmem")
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in fields:
            found[name] = int(value.split()[0]) / 1024
    return found


class PeakSampler(threading.Thread):
    """The largest private (RssAnon) and shared (RssShmem) resident memory, sampled every 20 ms.
    VmHWM counts both: shared pages are Ray's object store, mapped into the driver where it put or
    read objects."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = {"RssAnon": 0.0, "RssShmem": 0.0}
        self.running = True

    def run(self) -> None:
        while self.running:
            now = status_mb()
            for name in self.peak:
                self.peak[name] = max(self.peak[name], now.get(name, 0.0))
            time.sleep(0.02)


def one_build(mode: str, root: Path, pairs: int, workers: int, shard_chunks: int) -> dict:
    """Build in this process (``mode`` one or ray) and report its peak memory."""
    from qcg_gpu import build_index
    from qcg_gpu.log import quiet

    quiet()
    cluster = None
    if mode == "ray":
        import torch

        torch.set_num_threads(1)  # the workers take the driver's thread count: one core each, as Ray shares them
        from qcg_gpu.cluster import RayCluster
        from qcg_gpu.config import RayConfig

        cluster = RayCluster(RayConfig(ray=True, ray_workers=workers, ray_shard_chunks=shard_chunks))
    sampler = PeakSampler()
    sampler.start()
    start = time.perf_counter()
    summary = build_index(root / "docs.jsonl", root / f"index-{mode}", config(root, pairs), cluster=cluster)
    seconds = time.perf_counter() - start
    sampler.running = False
    sampler.join()
    assert summary.generated_chunks == 0 and summary.stored_chunks == summary.chunks, "replies must be replayed"
    return {
        "mode": mode,
        "chunks": summary.chunks,
        "nodes": summary.nodes,
        "peak_mb": round(status_mb()["VmHWM"]),
        "peak_private_mb": round(sampler.peak["RssAnon"]),
        "peak_shared_mb": round(sampler.peak["RssShmem"]),
        "seconds": round(seconds, 1),
        "stage_seconds": {k: round(v, 1) for k, v in summary.seconds.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--pairs", type=int, default=1, help="pairs per chunk in the stored replies (M)")
    parser.add_argument("--modes", nargs="+", default=["one", "ray"], choices=["one", "ray"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shard-chunks", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=None, help="append the JSON rows to this file")
    parser.add_argument("--build", help=argparse.SUPPRESS)  # internal: MODE,ROOT, run in a fresh process
    args = parser.parse_args()
    if args.build:
        mode, root = args.build.split(",", 1)
        print(json.dumps(one_build(mode, Path(root), args.pairs, args.workers, args.shard_chunks)))
        return

    from qcg_gpu.capabilities import cpu_kind

    print(f"# CPU: {cpu_kind()}", flush=True)
    for n in args.chunks:
        with tempfile.TemporaryDirectory() as work:
            write_inputs(Path(work), n, args.pairs)
            for mode in args.modes:
                command = [sys.executable, __file__, "--build", f"{mode},{work}", "--pairs", str(args.pairs)]
                command += ["--workers", str(args.workers), "--shard-chunks", str(args.shard_chunks)]
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode:
                    sys.exit(f"{mode} build of {n} chunks failed:\n{done.stderr[-3000:]}")
                row = {**json.loads(done.stdout.strip().splitlines()[-1]), "cpu": cpu_kind()}
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "a") as fh:
                        fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
