"""What batch-invariant embedding costs: qcg's fixed-shape batches, at each batch size asked,
against sentence-transformers' own batching (padded to each batch's longest text), side by side
on the same texts.

    python benchmarks/bench_embedding.py [--texts 2000] [--repeat 3] [--batch-sizes 32 128]

Texts: the bundled LiHuaWorld sample's lines (short, like q + a nodes and sentences), its chat
logs cut into ~1,000-character pieces (like windows of long chunks), and its 26 logs whole (a
small job, like the quickstart's chunks: few texts per padded length, so a large fixed batch
is mostly copies). Prints texts/s of each and the time ratios, per kind, as JSON lines; the
CPU's model name comes first.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from qcg_gpu.capabilities import cpu_kind
from qcg_gpu.embedding import BATCH_SIZE, Embedder

SAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lihuaworld_sample" / "docs"


def texts_of(kind: str, n: int) -> list[str]:
    logs = [p.read_text() for p in sorted(SAMPLE.rglob("*.txt"))]
    if kind == "whole_logs":
        return logs
    if kind == "lines":
        pool = [line for log in logs for line in log.splitlines() if line.strip()]
    else:
        pool = [log[i : i + 1000] for log in logs for i in range(0, len(log), 1000)]
    return [pool[i % len(pool)] for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[BATCH_SIZE, 128])
    args = parser.parse_args()
    embedder = Embedder(device="cpu")
    print(json.dumps({"cpu": cpu_kind(), "torch_threads": __import__("torch").get_num_threads()}))
    for kind in ("lines", "pieces", "whole_logs"):
        texts = texts_of(kind, args.texts)
        times: dict[str, list[float]] = {f"fixed_{b}": [] for b in args.batch_sizes}
        times["sentence_transformers"] = []
        for _ in range(args.repeat):  # alternated, so all see the same machine
            for b in args.batch_sizes:
                embedder.batch_size = b
                start = time.perf_counter()
                ours = embedder.encode(texts)
                times[f"fixed_{b}"].append(time.perf_counter() - start)
            start = time.perf_counter()
            pieces = embedder.windows.split(texts)  # sentence-transformers would cut long texts
            theirs = embedder.model.encode(pieces.pieces, batch_size=BATCH_SIZE, normalize_embeddings=True)
            theirs = pieces.pool(theirs, len(texts)) if pieces.windowed else theirs
            times["sentence_transformers"].append(time.perf_counter() - start)
        best = {name: min(t) for name, t in times.items()}
        st = best["sentence_transformers"]
        print(
            json.dumps(
                {
                    "texts": kind,
                    "n": len(texts),
                    **{f"{name}_texts_per_s": round(len(texts) / s, 1) for name, s in best.items()},
                    **{
                        f"{name}_over_st_time": round(s / st, 2)
                        for name, s in best.items()
                        if name != "sentence_transformers"
                    },
                    "max_abs_difference": float(np.abs(ours - theirs).max()),
                }
            )
        )


if __name__ == "__main__":
    main()
