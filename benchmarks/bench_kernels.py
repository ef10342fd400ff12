"""The gather-dot step (similarities of the selected nodes to their query) three ways, side by
side in one run: torch's gather + einsum (what the torch backend did before), ``gather_dot``
(Triton on CUDA; einsum elsewhere) and, on CPU, the numba twin.

    python benchmarks/bench_kernels.py                       # CPU: einsum vs the numba twin
    python benchmarks/bench_kernels.py --device cuda         # GPU: einsum vs the Triton kernel
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from qcg_gpu.capabilities import cpu_kind
from qcg_gpu.kernels.gather_dot import gather_dot, gather_dot_cpu


def best_of(repeat: int, fn, device: str) -> float:
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--nodes", type=int, default=1_000_000)
    parser.add_argument("--queries", type=int, default=4096, help="one GPU tile")
    parser.add_argument(
        "--selected", type=int, default=140, help="nodes per query (n = 20 seeds, 2 hops of k = 2: <= 140)"
    )
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    nodes = rng.standard_normal((args.nodes, 384), dtype=np.float32)
    queries = rng.standard_normal((args.queries, 384), dtype=np.float32)
    ids = np.sort(rng.integers(0, args.nodes, (args.queries, args.selected)), axis=1)
    t_nodes, t_queries, t_ids = (torch.from_numpy(a).to(args.device) for a in (nodes, queries, ids))
    with torch.inference_mode():
        einsum = lambda: torch.einsum("bld,bd->bl", t_nodes[t_ids], t_queries)  # noqa: E731
        kernel = lambda: gather_dot(t_nodes, t_queries, t_ids)  # noqa: E731
        einsum(), kernel()  # compile, warm up
        row = {
            "device": args.device,
            "cpu": cpu_kind(),
            "nodes": args.nodes,
            "queries": args.queries,
            "selected": args.selected,
            "einsum_ms": round(best_of(args.repeat, einsum, args.device) * 1e3, 2),
            "gather_dot_ms": round(best_of(args.repeat, kernel, args.device) * 1e3, 2),
            "max_abs_diff": float((einsum() - kernel()).abs().max()),
        }
    if args.device == "cpu":
        gather_dot_cpu(nodes, queries, ids)
        row["numba_twin_ms"] = round(best_of(args.repeat, lambda: gather_dot_cpu(nodes, queries, ids), "cpu") * 1e3, 2)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
