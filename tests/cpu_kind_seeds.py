"""Run in a subprocess by tests/test_cpu_kinds.py, under an instruction-set cap that must be set
before torch loads: prints, as JSON, this process's int8 node codes and, per prefilter, how many of
the queries got other seeds or seed similarities than the float64 path (METHOD.md's selection); int8
by each GEMM route (``qcg_gpu/retrieval/int8_gemm.py``)."""

import json

import numpy as np

from qcg_gpu.retrieval import QCGIndex, RetrievalConfig, Retriever, int8_gemm, seed_threshold

GAMMA, N = 1.1, 10


def evenly_spread(rng, rows: int, dim: int) -> np.ndarray:
    """Unit vectors of uniform components: many components near the largest, so int8 codes near
    their limit meet in pairs, which is where a saturating int8 GEMM goes wrong."""
    x = rng.uniform(-1, 1, (rows, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def float64_seeds(nodes: np.ndarray, queries: np.ndarray) -> list[tuple[list[int], list[float]]]:
    sims = queries.astype(np.float64) @ nodes.astype(np.float64).T
    threshold = float(seed_threshold(GAMMA))
    out = []
    for row in sims:
        ids = np.flatnonzero(row >= threshold)
        ids = ids[np.lexsort((ids, -row[ids]))][:N]
        out.append((ids.tolist(), row[ids].astype(np.float32).tolist()))  # seed_sims are float32
    return out


def full_codes_exact(dim: int) -> bool:
    """Whether ``torch._int_mm`` sums full 8-bit codes exactly in a GEMM of the prefilter's size, on the
    codes whose pair sums pass int16 first (a check of capabilities' own small test GEMM)."""
    import torch

    rng = np.random.default_rng(5)
    queries = rng.integers(100, 128, (512, dim)).astype(np.int8)
    queries[256:, 1::2] *= -1
    nodes = rng.integers(117, 128, (6000, dim)).astype(np.int8)
    nodes[3000:] *= -1
    got = torch._int_mm(torch.from_numpy(queries), torch.from_numpy(nodes).T).numpy()
    return bool(np.array_equal(got, queries.astype(np.int64) @ nodes.T.astype(np.int64)))


def main() -> None:
    rng = np.random.default_rng(3)
    nodes = evenly_spread(rng, 6000, 384)
    queries = nodes[rng.integers(0, len(nodes), 500)] + 0.04 * evenly_spread(rng, 500, 384)
    queries = (queries / np.linalg.norm(queries, axis=1, keepdims=True)).astype(np.float32)
    empty = np.zeros(len(nodes) + 1, np.int64), np.zeros(0, np.int64)
    index = QCGIndex(None, {}, nodes, *empty, np.arange(len(nodes)) // 16, (len(nodes) + 15) // 16)
    want = float64_seeds(nodes, queries)
    report: dict = {"int8_full_codes_exact": full_codes_exact(nodes.shape[1])}
    runs = [
        ("int8", "int8", int8_gemm.IntMm),
        ("int8_matmul", "int8", int8_gemm.QuantizedLinear),
        ("bf16", "bf16", None),
    ]
    for name, prefilter, route in runs:
        if route is not None:
            report[f"{name}_node_code_max"] = int8_gemm.node_code_max(route(), nodes.shape[1])
            int8_gemm.for_this_cpu = route  # this process runs one route after the other
        config = RetrievalConfig(gamma=GAMMA, n=N, hops=0, top_k=5, backend="numpy", prefilter=prefilter)
        result = Retriever(index, config).search(queries)
        got = [
            ([s for s in ids.tolist() if s >= 0], sims[: (ids >= 0).sum()].tolist())
            for ids, sims in zip(result.seed_ids, result.seed_sims)
        ]
        report[name] = sum(g != w for g, w in zip(got, want))
    report["seeds_per_query"] = float(np.mean([len(ids) for ids, _ in want]))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
