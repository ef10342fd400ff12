"""What batch-invariant embedding costs: qcg's fixed-shape batches, at each batch size asked,
against sentence-transformers' own batching (padded to each batch's longest text), side by side
on the same texts.

    python benchmarks/bench_embedding.py [--texts 2000] [--repeat 3] [--batch-sizes 32 128]
    python benchmarks/bench_embedding.py --mkl-modes AUTO AUTO,STRICT [--texts 1000] [--repeat 3]

Texts: the bundled LiHuaWorld sample's lines (short, like q + a nodes and sentences), its chat
logs cut into ~1,000-character pieces (like windows of long chunks), and its 26 logs whole (a
small job, like the quickstart's chunks: few texts per padded length, so a large fixed batch
is mostly copies). Prints texts/s of each and the time ratios, per kind, as JSON lines; the
CPU's model name comes first.

``--mkl-modes`` measures what MKL's conditional numerical reproducibility modes (``MKL_CBWR``;
qcg sets ``AUTO,STRICT``, capabilities.MKL_REPRODUCIBLE) cost qcg's default batching: MKL reads
the mode once per process, so each mode runs in its own process, the modes alternated ``--repeat``
times, with the torch threads of this process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
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
    parser.add_argument("--mkl-modes", nargs="+", help="compare these MKL_CBWR values, each in its own process")
    parser.add_argument("--one-mode", help=argparse.SUPPRESS)  # a --mkl-modes child: this MKL_CBWR, fixed batches
    args = parser.parse_args()
    if args.mkl_modes:
        return compare_mkl_modes(args)
    if args.one_mode:
        return print(json.dumps(one_mode_rates(args)))
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


def one_mode_rates(args) -> dict[str, float]:
    """texts/s of qcg's default batching per kind of text, under MKL_CBWR=args.one_mode (set before
    the first GEMM, when MKL reads it)."""
    os.environ["MKL_CBWR"] = args.one_mode
    embedder = Embedder(device="cpu")
    rates = {}
    for kind in ("lines", "pieces", "whole_logs"):
        texts = texts_of(kind, args.texts)
        start = time.perf_counter()
        embedder.encode(texts)
        rates[kind] = len(texts) / (time.perf_counter() - start)
    return rates


def compare_mkl_modes(args) -> None:
    import torch

    threads = torch.get_num_threads()
    print(json.dumps({"cpu": cpu_kind(), "torch_threads": threads, "mkl_modes": args.mkl_modes}))
    best: dict[str, dict[str, float]] = {mode: {} for mode in args.mkl_modes}
    for _ in range(args.repeat):  # alternated, so every mode sees the same machine
        for mode in args.mkl_modes:
            command = [sys.executable, __file__, "--one-mode", mode, "--texts", str(args.texts)]
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
            for kind, rate in json.loads(out.strip().splitlines()[-1]).items():
                best[mode][kind] = max(best[mode].get(kind, 0.0), rate)
    first = args.mkl_modes[0]
    for kind in best[first]:
        row = {"texts": kind, **{f"{mode}_texts_per_s": round(best[mode][kind], 1) for mode in best}}
        row |= {f"{mode}_over_{first}_time": round(best[first][kind] / best[mode][kind], 3) for mode in best}
        print(json.dumps(row))


if __name__ == "__main__":
    main()
