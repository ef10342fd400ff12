import itertools
import re
import subprocess
import sys

import numpy as np
import pytest

from qcg_gpu.capabilities import WITH_TORCH
from qcg_gpu.errors import QCGError
from qcg_gpu.indexing.knn import knn_graph
from qcg_gpu.retrieval import QCGIndex, RetrievalConfig, Retriever, check_queries

from .conftest import DEVICES, INT8_ROUTES, RETRIEVAL_BACKENDS
from .reference import reference_search

BACKENDS = [p for p in RETRIEVAL_BACKENDS if p.id != "numpy-int8"] + INT8_ROUTES  # int8 by each GEMM route


def random_index(seed: int, n_nodes: int, dim: int, k: int, n_chunks: int) -> QCGIndex:
    rng = np.random.default_rng(seed)
    # clustered unit vectors, so thresholds at gamma 1.5 (cosine 0.5) select something
    centers = rng.standard_normal((8, dim))
    x = centers[rng.integers(0, 8, n_nodes)] + 0.6 * rng.standard_normal((n_nodes, dim))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    graph = knn_graph(x, k, "torch", "cpu")
    node_chunk = np.sort(rng.integers(0, n_chunks, n_nodes))
    return QCGIndex(None, {}, x, graph.indptr, graph.indices, node_chunk.astype(np.int64), n_chunks)


def queries_for(index: QCGIndex, seed: int, b: int, noise: float = 0.5) -> np.ndarray:
    """Unit queries off random nodes of ``index`` (Gaussian ``noise`` a coordinate)."""
    rng = np.random.default_rng(seed)
    picks = index.node_embeddings[rng.integers(0, len(index.node_embeddings), b)]
    q = picks + noise * rng.standard_normal(picks.shape).astype(np.float32)
    return (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)


def assert_matches_reference(index, queries, result, config):
    for b, q in enumerate(queries):
        seeds, selected, chunks, scores = reference_search(
            index.node_embeddings,
            index.knn_indptr,
            index.knn_indices,
            index.node_chunk,
            q,
            config.gamma,
            config.n,
            config.hops,
            config.top_k,
        )
        got = [c for c in result.chunk_ids[b].tolist() if c >= 0]
        assert got == chunks, f"query {b}"
        np.testing.assert_allclose(result.scores[b, : len(got)], scores, atol=1e-5)
        assert [s for s in result.seed_ids[b].tolist() if s >= 0] == seeds
        assert result.n_selected[b] == len(selected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_backends_match_reference_over_a_parameter_grid(backend, k):
    index = random_index(k, 600, 32, k, n_chunks=90)
    queries = queries_for(index, k, 40)
    retriever = Retriever(index, RetrievalConfig(**backend))
    for hops, n, gamma, top_k in itertools.product([0, 1, 2], [1, 7, 20], [0.4, 1.0, 1.5], [1, 5]):
        config = RetrievalConfig(gamma=gamma, n=n, hops=hops, top_k=top_k, **backend)
        assert_matches_reference(index, queries, retriever.search(queries, config), config)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_seed_above_threshold_gives_no_chunks(backend):
    index = random_index(0, 200, 16, 2, 30)
    queries = queries_for(index, 0, 5)
    result = Retriever(index, RetrievalConfig(gamma=2.0, **backend)).search(-queries * 0 + queries)
    exact = (queries @ index.node_embeddings.T >= 1.0).any(axis=1)
    assert not exact.any()
    assert (result.chunk_ids == -1).all() and np.isneginf(result.scores).all() and (result.n_selected == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_node_exactly_at_the_threshold_is_a_seed(backend):
    """sim + 1 >= gamma, not >: a node whose similarity is exactly gamma - 1 is a seed, one a float32 step
    below is not. The similarities 0.5 and 0.25 are exact in float32 and bf16 alike."""
    nodes = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]], np.float32)
    graph = knn_graph(nodes, 1, "torch", "cpu")
    index = QCGIndex(None, {}, nodes, graph.indptr, graph.indices, np.arange(3, dtype=np.int64), 3)
    query = np.array([[0.5, 0.25, 0.0, np.sqrt(1 - 0.5**2 - 0.25**2)]], np.float32)  # sims 0.5, 0.25, 0
    exactly = Retriever(index, RetrievalConfig(gamma=1.5, n=5, hops=0, **backend)).search(query)
    assert exactly.seed_ids[0].tolist()[:2] == [0, -1] and exactly.chunk_ids[0].tolist()[:2] == [0, -1]
    assert exactly.seed_sims[0, 0] == np.float32(0.5)
    above = Retriever(
        index, RetrievalConfig(gamma=float(np.nextafter(np.float32(1.5), np.float32(2))), n=5, hops=0, **backend)
    ).search(query)
    assert above.seed_ids[0, 0] == -1 and above.chunk_ids[0, 0] == -1
    both = Retriever(index, RetrievalConfig(gamma=1.25, n=5, hops=0, **backend)).search(query)
    assert both.seed_ids[0].tolist()[:3] == [0, 1, -1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_ties_break_by_lower_ids(backend):
    # entries of 0.5 on 4 of 16 axes: unit vectors whose dot products are exact, so ties are exact
    patterns = [(0, 1, 2, 3), (0, 1, 2, 4), (0, 1, 2, 5), (0, 1, 2, 6), (0, 1, 2, 3), (8, 9, 10, 11), (0, 1, 2, 3)]
    x = np.zeros((len(patterns), 16), np.float32)
    for i, axes in enumerate(patterns):
        x[i, list(axes)] = 0.5
    graph = knn_graph(x, 2)
    node_chunk = np.array([3, 2, 1, 0, 4, 5, 4])
    index = QCGIndex(None, {}, x, graph.indptr, graph.indices, node_chunk, 6)
    query = x[:1].copy()  # sims: 1, .75, .75, .75, 1, 0, 1
    config = RetrievalConfig(gamma=1.0, n=3, hops=0, top_k=6, **backend)
    retriever = Retriever(index, config)
    # the torch backend's threshold-first selection, also over node blocks of 2 (ties across blocks)
    for node_block in [None] + ([2] if backend["backend"] == "torch" else []):
        if node_block:
            retriever.backend.node_block = node_block
        result = retriever.search(query, config)
        assert result.seed_ids[0].tolist() == [0, 4, 6]  # the three exact matches, by id
        assert result.chunk_ids[0].tolist() == [3, 4, -1, -1, -1, -1]  # chunk 3 and 4 tie at 1.0: lower id first
        result = retriever.search(query, RetrievalConfig(**{**vars(config), "n": 5}))
        assert result.seed_ids[0].tolist() == [0, 4, 6, 1, 2]  # .75-ties: ids 1, 2 (not 3)
        assert result.chunk_ids[0].tolist()[:4] == [3, 4, 1, 2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunk_reached_only_through_expansion(backend):
    index = random_index(3, 400, 24, 3, 120)
    queries = queries_for(index, 3, 30)
    config = RetrievalConfig(gamma=1.5, n=3, hops=2, top_k=5, **backend)
    result = Retriever(index, config).search(queries)
    assert_matches_reference(index, queries, result, config)
    seed_chunks = [set(index.node_chunk[s[s >= 0]].tolist()) for s in result.seed_ids]
    only_expanded = [c for b, row in enumerate(result.chunk_ids) for c in row if c >= 0 and c not in seed_chunks[b]]
    assert only_expanded  # such chunks exist and are ranked like the others


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_indexes(backend):
    for n_nodes in (1, 2):
        x = np.eye(n_nodes, 4, dtype=np.float32)
        graph = knn_graph(x, 2)
        index = QCGIndex(None, {}, x, graph.indptr, graph.indices, np.zeros(n_nodes, np.int64), 1)
        config = RetrievalConfig(gamma=1.0, n=5, hops=2, top_k=3, **backend)
        result = Retriever(index, config).search(x[:1])
        assert result.chunk_ids[0].tolist() == [0]  # a column per chunk the index has, at most top_k
        assert result.seed_ids.shape == (1, n_nodes) and result.n_selected[0] == n_nodes


PREFILTERS = BACKENDS  # every precision is a prefilter, float32 ("off") included
TORCH_BACKENDS = [p for p in BACKENDS if p.values[0]["backend"] == "torch"]


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
@pytest.mark.parametrize("selection", ["threshold-first", "node-blocks", "topk"])
def test_torch_seed_selection_paths_match_reference(backend, selection):
    """Threshold first in one node block or in several (the last partial), and the topk path that a
    tile with more candidates than the budget takes: the reference's seeds and chunks either way."""
    index = random_index(11, 2000, 24, 2, n_chunks=200)
    queries = queries_for(index, 11, 300)
    retriever = Retriever(index, RetrievalConfig(**backend))
    torch_backend = retriever.backend
    torch_backend.tile_rows = 128  # three query tiles, the last partial
    if selection == "node-blocks":
        torch_backend.node_block = 333
    if selection == "topk":
        torch_backend.candidate_budget = 0
    for gamma, n, hops in [(1.5, 10, 1), (1.0, 15, 0), (0.4, 5, 2)]:
        config = RetrievalConfig(gamma=gamma, n=n, hops=hops, top_k=5, **backend)
        assert_matches_reference(index, queries, retriever.search(queries, config), config)
    assert (torch_backend.topk_tiles > 0) == (selection == "topk")


@pytest.mark.parametrize("backend", PREFILTERS)
def test_prefilter_over_several_tiles_matches_reference(backend):
    # > 8192 nodes and > 512 queries: several GEMM blocks per row tile, a partial last block, two row tiles
    index = random_index(7, 9000, 24, 2, n_chunks=700)
    queries = queries_for(index, 7, 530)
    for gamma, n in [(1.5, 10), (1.0, 15)]:
        config = RetrievalConfig(gamma=gamma, n=n, hops=1, top_k=5, **backend)
        assert_matches_reference(index, queries, Retriever(index, config).search(queries), config)


@pytest.mark.parametrize("backend", PREFILTERS)
def test_prefilter_falls_back_on_rows_of_near_ties(backend):
    # 3000 copies of one vector overflow the candidate buffer of a query near them: that row is rescored
    # over every node (ties by lower id), the other rows stay on the prefilter
    rng = np.random.default_rng(5)
    x = np.vstack([np.tile(rng.standard_normal(16), (3000, 1)), rng.standard_normal((500, 16))])
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    graph = knn_graph(x, 2, "torch", "cpu")
    index = QCGIndex(None, {}, x, graph.indptr, graph.indices, np.arange(len(x)) // 10, len(x) // 10)
    queries = np.vstack([x[:1], x[3000:3004]])
    config = RetrievalConfig(gamma=1.5, n=12, hops=1, top_k=5, **backend)
    retriever = Retriever(index, config)
    if backend["backend"] == "torch":
        retriever.backend.candidate_budget = 0  # its threshold-first selection has no candidate buffer to overflow
    result = retriever.search(queries)
    assert retriever.backend.fallback_rows == 1
    assert result.seed_ids[0].tolist() == list(range(12))
    # the same numbers as every other path: the numpy bf16 prefilter's, whose row 0 has no fallback
    other = RetrievalConfig(**{**vars(config), "backend": "numpy", "device": None, "prefilter": "bf16"})
    exact = Retriever(index, other).search(queries)
    for field in ("seed_ids", "seed_sims", "chunk_ids", "n_selected"):
        np.testing.assert_array_equal(getattr(result, field), getattr(exact, field), err_msg=field)
    # chunk means average float32 dot products, summed in each backend's own order: the last bits differ
    np.testing.assert_allclose(result.scores, exact.scores, rtol=0, atol=1e-6)


EXACT_PREFILTERS = [{"backend": "torch", "device": d, "prefilter": p} for d in DEVICES for p in ("off", "bf16")]
EXACT_PREFILTERS += [{"backend": "numpy", "prefilter": p} for p in ("off", "int8")]


@pytest.mark.skipif(not WITH_TORCH, reason="the prefilters run their GEMM in torch")
@pytest.mark.parametrize("other", EXACT_PREFILTERS, ids=lambda o: "-".join(o.values()))
def test_prefilters_rescore_exactly_on_every_backend(other):
    # Each bound covers the exact similarity, so every precision, float32 included, rescores its
    # candidates in float64: a float32 value is off by up to d 2^-24 |q||u| and differs from the numpy
    # bf16 prefilter's in the last bits. So every path gives the same seeds and sims.
    index = random_index(3, 3000, 384, 2, n_chunks=300)
    queries = queries_for(index, 3, 200)
    config = RetrievalConfig(gamma=1.0, n=10, hops=1, top_k=5, backend="numpy", prefilter="bf16")
    numpy_result = Retriever(index, config).search(queries)
    other_result = Retriever(index, RetrievalConfig(**{**vars(config), **other})).search(queries)
    assert (numpy_result.seed_ids >= 0).sum() > 1000
    np.testing.assert_array_equal(other_result.seed_ids, numpy_result.seed_ids)
    np.testing.assert_array_equal(other_result.seed_sims, numpy_result.seed_sims)
    exact = (queries.astype(np.float64) @ index.node_embeddings.T.astype(np.float64)).astype(np.float32)
    seeds = numpy_result.seed_ids >= 0
    rows = np.nonzero(seeds)[0]
    np.testing.assert_array_equal(other_result.seed_sims[seeds], exact[rows, numpy_result.seed_ids[seeds]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeds_at_near_ties_of_the_threshold_rank_by_the_exact_similarity(backend):
    """Nodes whose similarity to the query lies within float32 rounding of the threshold (and of each
    other): the seeds are those whose float64 similarity passes, ranked by it, with its float32 rounding
    as seed_sims, on every backend and precision (a float32 GEMM alone gets these wrong)."""
    rng = np.random.default_rng(9)
    dim, threshold = 384, 0.5
    query = unit_rows(rng, 1, dim)[0].astype(np.float64)
    others = unit_rows(rng, 64, dim).astype(np.float64)
    others -= np.outer(others @ query, query)  # orthogonal to the query
    others /= np.linalg.norm(others, axis=1, keepdims=True)
    target = threshold + np.linspace(-4e-7, 4e-7, 64)  # float32 steps near 0.5 are 6e-8: ~13 values a step
    nodes = (target[:, None] * query + np.sqrt(1 - target[:, None] ** 2) * others).astype(np.float32)
    nodes = np.vstack([nodes, unit_rows(rng, 500, dim)])
    graph = knn_graph(nodes, 2, "torch", "cpu")
    index = QCGIndex(None, {}, nodes, graph.indptr, graph.indices, np.arange(len(nodes)) // 8, (len(nodes) + 7) // 8)
    queries = query[None, :].astype(np.float32)
    exact = queries.astype(np.float64) @ nodes.T.astype(np.float64)
    config = RetrievalConfig(gamma=1 + threshold, n=20, hops=1, top_k=5, **backend)
    result = Retriever(index, config).search(queries)
    passing = np.flatnonzero(exact[0] >= np.float32(threshold))
    want = passing[np.lexsort((passing, -exact[0, passing]))][:20]
    assert 5 < len(want) <= 20 and len(passing) < 64  # the threshold cuts through the near-ties
    assert result.seed_ids[0, : len(want)].tolist() == want.tolist()
    assert (result.seed_ids[0, len(want) :] == -1).all()
    np.testing.assert_array_equal(result.seed_sims[0, : len(want)], exact[0, want].astype(np.float32))


@pytest.mark.skipif(not WITH_TORCH, reason="the precision flags are torch's")
@pytest.mark.parametrize("backend", BACKENDS)
def test_tf32_allowed_by_the_host_process_changes_nothing(backend):
    """A host that allows TF32 (CUDA) or reduced-precision float32 GEMMs (oneDNN on CPU) for its own work:
    the exact paths set IEEE float32 for their GEMMs, so seeds and sims stay those of every other path."""
    import torch

    index = random_index(4, 3000, 384, 2, n_chunks=300)
    queries = queries_for(index, 4, 100)
    config = RetrievalConfig(gamma=1.0, n=10, hops=1, top_k=5, **backend)
    numpy_bf16 = {"backend": "numpy", "device": None, "prefilter": "bf16"}
    reference = Retriever(index, RetrievalConfig(**{**vars(config), **numpy_bf16}))
    expected = reference.search(queries)
    saved = torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = torch.backends.mkldnn.matmul.fp32_precision = "tf32"
    try:
        result = Retriever(index, config).search(queries)
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # the host's setting is given back
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision = saved
    for field in ("seed_ids", "seed_sims", "chunk_ids"):
        np.testing.assert_array_equal(getattr(result, field), getattr(expected, field), err_msg=field)


@pytest.mark.skipif(not WITH_TORCH, reason="the precision flags are torch's")
def test_a_thread_leaving_the_exact_block_keeps_another_threads_gemm_exact():
    """torch's precision flags are per process: thread A enters, B enters, A leaves while B is still in its
    GEMM. B must still compute in IEEE float32, and the host's settings come back when the last one leaves."""
    import threading

    import torch

    from qcg_gpu.capabilities import ieee_float32_matmul

    flags = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul
    saved = [f.fp32_precision for f in flags]
    for f in flags:
        f.fp32_precision = "tf32"
    inside, leave = threading.Event(), threading.Event()

    def thread_a():
        with ieee_float32_matmul():
            inside.set()
            leave.wait(10)

    try:
        a = threading.Thread(target=thread_a)
        a.start()
        inside.wait(10)
        with ieee_float32_matmul():  # thread B (this one)
            leave.set()
            a.join(10)  # A has left the block; B is still inside
            assert [f.fp32_precision for f in flags] == ["ieee", "ieee"]
        assert [f.fp32_precision for f in flags] == ["tf32", "tf32"]  # the last one out restores the host's
    finally:
        for f, value in zip(flags, saved):
            f.fp32_precision = value


@pytest.mark.skipif(not WITH_TORCH, reason="the precision flags are torch's")
@pytest.mark.parametrize("backend", BACKENDS)
def test_searches_in_two_threads_under_a_bf16_host_stay_exact(backend):
    """The docs' one Retriever per thread, on a host that set oneDNN's bf16 and CUDA's TF32 for float32
    GEMMs and bf16 reductions in low precision: every result of two threads searching at once equals the
    single-threaded one of the same backend with the host's defaults."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    index = random_index(5, 20000, 384, 2, n_chunks=1000)
    queries = queries_for(index, 5, 256)
    config = RetrievalConfig(gamma=1.0, n=10, hops=1, top_k=5, **backend)
    expected = Retriever(index, config).search(queries)
    cuda, mkldnn = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul
    saved = cuda.fp32_precision, mkldnn.fp32_precision, cuda.allow_bf16_reduced_precision_reduction
    cuda.fp32_precision, mkldnn.fp32_precision, cuda.allow_bf16_reduced_precision_reduction = "tf32", "bf16", True
    try:
        with ThreadPoolExecutor(2) as pool:
            retrievers = [Retriever(index, config) for _ in range(2)]
            results = list(pool.map(lambda i: [retrievers[i % 2].search(queries) for _ in range(4)], range(2)))
    finally:
        cuda.fp32_precision, mkldnn.fp32_precision, cuda.allow_bf16_reduced_precision_reduction = saved
    for result in (r for runs in results for r in runs):
        for field in ("seed_ids", "seed_sims", "chunk_ids", "scores"):
            np.testing.assert_array_equal(getattr(result, field), getattr(expected, field), err_msg=field)


@pytest.mark.skipif(not WITH_TORCH, reason="the torch backend's rescoring")
@pytest.mark.parametrize("device", DEVICES)
def test_float64_rescoring_gives_a_pair_the_same_bits_in_any_batch_and_on_any_device(device):
    """Node shards searched apart rank their seeds by these numbers, merged as one process would."""
    import torch

    from qcg_gpu.retrieval.torch_backend import pair_dot

    rng = np.random.default_rng(0)
    nodes = torch.from_numpy(unit_rows(rng, 5000, 384))
    queries = torch.from_numpy(unit_rows(rng, 64, 384))
    ids, rows = torch.from_numpy(rng.integers(0, 5000, 200000)), torch.from_numpy(rng.integers(0, 64, 200000))
    on_cpu = pair_dot(torch, nodes, queries, ids, rows)
    nodes, queries, ids, rows = (t.to(device) for t in (nodes, queries, ids, rows))
    whole = pair_dot(torch, nodes, queries, ids, rows).cpu()
    alone = torch.cat([pair_dot(torch, nodes, queries, ids[i : i + 7], rows[i : i + 7]) for i in range(0, 70, 7)])
    assert torch.equal(whole, on_cpu) and torch.equal(alone.cpu(), on_cpu[:70])
    exact = (nodes[ids].double() * queries[rows].double()).cpu().numpy()
    np.testing.assert_allclose(whole.numpy(), exact.sum(1), rtol=0, atol=1e-15)


def unit_rows(rng, rows: int, dim: int, around=None) -> np.ndarray:
    x = rng.standard_normal((rows, dim)) if around is None else around + 0.3 * rng.standard_normal((rows, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def nodes_only(x: np.ndarray) -> QCGIndex:
    return QCGIndex(None, {}, x, np.zeros(len(x) + 1, np.int64), np.zeros(0, np.int64), np.zeros(len(x), np.int64), 1)


@pytest.mark.skipif(not WITH_TORCH, reason="the prefilters run their GEMM in torch")
@pytest.mark.parametrize("kind, route", [("bf16", None), ("int8", "IntMm"), ("int8", "QuantizedLinear")])
def test_prefilter_error_bounds_hold_for_the_real_gemm(kind, route):
    """Every approximate similarity the scan reads (the real GEMM's output as keys, valued as the
    kernel values them) lies within the bound of the exact one, and the bound is tight enough to prune."""
    from qcg_gpu.kernels import prefilter_cpu
    from qcg_gpu.retrieval import int8_gemm
    from qcg_gpu.retrieval.numpy_backend import PREFILTERS

    rng = np.random.default_rng(11)
    for dim in (16, 384):
        x = unit_rows(rng, 4000, dim)
        q = unit_rows(rng, 300, dim, around=x[:300])
        x[7] *= 0  # a zero node and a zero query: scales stay finite, the bound still holds
        q[5] *= 0
        prefilter = PREFILTERS[kind](nodes_only(x), **({"gemm": getattr(int8_gemm, route)()} if route else {}))
        tile, bound, unit = prefilter.round_tile(q)
        keys = prefilter.keys(tile, 0, prefilter.output(len(q)))
        if kind == "bf16":
            sortable = keys ^ ((keys >> 15) & 0x7FFF)  # as qcg_gpu/kernels/prefilter_cpu.py's sortable()
            approx = prefilter_cpu.VALUES[sortable.astype(np.int32) + 32768]
        else:
            approx = keys.astype(np.float32) * unit[:, None]
        error = np.abs(q.astype(np.float64) @ x.T.astype(np.float64) - approx)
        assert (error <= bound[:, None]).all()
        assert bound.max() < {"bf16": 0.02, "int8": 0.05}[kind]  # a few rounding steps


@pytest.mark.skipif(not WITH_TORCH, reason="the int8 GEMM is torch's")
def test_the_matmul_route_keeps_node_codes_whose_sums_a_float32_holds():
    """oneDNN's matmul route returns float32, exact below 2^24: past that the node codes shrink, then int8
    is refused, even where the test GEMM's sums (d x 127 x 127, even) would come out right."""
    from qcg_gpu.retrieval import int8_gemm

    route = int8_gemm.QuantizedLinear()
    assert int8_gemm.node_code_max(route, 384) in (127, 63)  # 63 where its kernel saturates (AVX2 alone)
    assert int8_gemm.node_code_max(route, 1100) == 63  # 1100 x 127 x 127 > 2^24
    assert int8_gemm.node_code_max(route, 2100) == 0  # 2100 x 127 x 63 > 2^24


CPU_FLAGS = {  # /proc/cpuinfo flags of the CPU kinds the prefilter choice tells apart
    "Sapphire Rapids (AMX)": {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"},
    "Zen 4 (AVX512-BF16, no AMX)": {"avx2", "avx512f", "avx512_vnni", "avx512_bf16"},
    "Cascade Lake (VNNI)": {"avx2", "avx512f", "avx512_vnni"},
    "Zen 3 (AVX2)": {"avx2"},
    "Arm": {"asimd", "sve"},
}


@pytest.mark.parametrize(
    "cpu, want",
    [("Sapphire Rapids (AMX)", "bf16"), ("Zen 4 (AVX512-BF16, no AMX)", "int8"), ("Cascade Lake (VNNI)", "int8")]
    + [("Zen 3 (AVX2)", "int8"), ("Arm", None)],
)
def test_auto_prefilter_takes_the_fastest_measured_gemm(monkeypatch, cpu, want):
    """bf16 only with AMX (AVX512-BF16 alone measured 0.6x float32), int8 on other x86 CPUs (by oneDNN's
    matmul primitive without VNNI: 2.2x float32 on a real Zen 3), and the float32 GEMM where nothing was
    measured faster; an explicit choice is kept."""
    from qcg_gpu import capabilities
    from qcg_gpu.retrieval.retriever import prefilter_kind

    monkeypatch.setattr(capabilities, "_cpuinfo", lambda: ("a CPU", frozenset(CPU_FLAGS[cpu])))
    assert prefilter_kind(RetrievalConfig(backend="numpy")) == (want if WITH_TORCH else None)
    assert prefilter_kind(RetrievalConfig(backend="numpy", prefilter="off")) is None
    assert prefilter_kind(RetrievalConfig(backend="numpy", prefilter="int8")) == "int8"
    with pytest.raises(QCGError, match="int8 runs on the numpy backend"):
        prefilter_kind(RetrievalConfig(backend="torch", prefilter="int8"))


@pytest.mark.skipif(not WITH_TORCH, reason="the bf16 GEMM is torch's")
@pytest.mark.parametrize("cpu", ["Sapphire Rapids (AMX)", "Zen 4 (AVX512-BF16, no AMX)", "Zen 3 (AVX2)"])
def test_an_explicit_bf16_prefilter_without_amx_says_it_is_slow(monkeypatch, capsys, cpu):
    """--prefilter bf16 ran 5.8x slower than float32 on a Zen 3 (179 against 1,043 q/s, 100k nodes) without a
    word; it still runs, equal to float32, and says so once a run."""
    from qcg_gpu import capabilities
    from qcg_gpu.retrieval import retriever

    monkeypatch.setattr(capabilities, "_cpuinfo", lambda: ("a CPU", frozenset(CPU_FLAGS[cpu])))
    retriever._warn_bf16_without_amx.cache_clear()
    index = random_index(5, 500, 32, 4, 50)
    want = Retriever(index, RetrievalConfig(backend="numpy", prefilter="off")).search(index.node_embeddings[:20])
    for _ in range(2):
        got = Retriever(index, RetrievalConfig(backend="numpy", prefilter="bf16")).search(index.node_embeddings[:20])
        assert np.array_equal(want.chunk_ids, got.chunk_ids) and np.array_equal(want.seed_sims, got.seed_sims)
    warned = capsys.readouterr().err.count("--prefilter bf16 on a CPU without AMX")
    assert warned == (0 if cpu.startswith("Sapphire Rapids") else 1)
    retriever._warn_bf16_without_amx.cache_clear()


@pytest.mark.skipif(not WITH_TORCH, reason="the int8 GEMM is torch's")
def test_auto_prefilter_keeps_float32_where_the_int8_gemm_is_not_exact(monkeypatch):
    """A CPU whose int8 GEMM sums no node codes exactly (node_code_max 0, simulated): auto takes the
    float32 GEMM and retrieves, while an explicit --prefilter int8 is refused in one line."""
    from qcg_gpu import capabilities
    from qcg_gpu.retrieval import int8_gemm, retriever

    monkeypatch.setattr(capabilities, "_cpuinfo", lambda: ("a CPU", frozenset(CPU_FLAGS["Cascade Lake (VNNI)"])))
    monkeypatch.setattr(int8_gemm, "node_code_max", lambda gemm, dim: 0)
    index = random_index(5, 500, 32, 4, 50)
    assert retriever.prefilter_kind(RetrievalConfig(backend="numpy"), dim=index.dim) is None
    want = Retriever(index, RetrievalConfig(backend="numpy", prefilter="off")).search(index.node_embeddings[:20])
    got = Retriever(index, RetrievalConfig(backend="numpy")).search(index.node_embeddings[:20])
    assert np.array_equal(want.chunk_ids, got.chunk_ids) and np.array_equal(want.seed_sims, got.seed_sims)
    with pytest.raises(QCGError, match="does not sum exactly; use --prefilter off"):
        Retriever(index, RetrievalConfig(backend="numpy", prefilter="int8"))


def test_query_checks():
    assert np.allclose(np.linalg.norm(check_queries(np.array([[3.0, 4.0]]), 2), axis=1), 1.0)
    assert np.allclose(check_queries(np.full((1, 4), 1e30), 4), 0.5)  # squares overflow float32: still normalised
    for bad, message in [
        (np.ones((2, 3)), "shape"),
        (np.array([[np.nan, 1.0]]), "NaN"),
        (np.zeros((1, 2)), "all zeros"),
    ]:
        with pytest.raises(QCGError, match=message):
            check_queries(bad, 2)


@pytest.mark.parametrize(
    "options,message",
    [
        ({"gamma": 2.5}, "--gamma (gamma) must be in [0, 2], got 2.5"),
        ({"n": 0}, "--n (n) must be >= 1, got 0"),
        ({"top_k": 0}, "--top-k (top_k) must be >= 1, got 0"),
        ({"hops": 4}, "--hops (hops) must be in 0..3, got 4"),
    ],
)
def test_bad_parameters(options, message):
    with pytest.raises(QCGError, match=re.escape(message)):
        RetrievalConfig(**options).validate()


def test_trace_matches_a_plain_python_walk():
    """The trace view (the CPU backend's kernels) against breadth-first sets and means in plain Python."""
    from qcg_gpu.eval.bench import synthetic_index, synthetic_queries
    from qcg_gpu.retrieval import trace_queries, trace_query

    index = synthetic_index(3000, k=4)
    queries = synthetic_queries(index, 8)
    config = RetrievalConfig(gamma=1.5, hops=2)
    result = Retriever(index, config).search(queries)
    batch = trace_queries(index, queries, result, config.hops)  # one compact graph for the batch
    for b in range(len(queries)):
        trace = trace_query(index, queries[b], result.seed_ids[b], result.seed_sims[b], config.hops)
        assert batch[b] == trace
        seeds = [int(u) for u in result.seed_ids[b] if u >= 0]
        selected, frontier, per_hop = set(seeds), set(seeds), []
        for _ in range(config.hops):
            frontier = {
                int(v) for u in frontier for v in index.knn_indices[index.knn_indptr[u] : index.knn_indptr[u + 1]]
            } - selected
            selected |= frontier
            per_hop.append(frontier)
        assert [s["node_id"] for s in trace["seeds"]] == seeds
        found, start = trace["expanded"], 0
        for hop in per_hop:  # each hop's nodes, in the order the walk found them
            assert set(found[start : start + len(hop)]) == hop
            start += len(hop)
        assert start == len(found) and trace["hop_sizes"] == [len(hop) for hop in per_hop]
        sims = {u: float(index.node_embeddings[u] @ queries[b]) for u in selected}
        assert trace["expanded_sims"] == pytest.approx([sims[u] for u in found], abs=1e-6)
        means: dict[int, list[float]] = {}
        for u in selected:
            means.setdefault(int(index.node_chunk[u]), []).append(sims[u])
        assert {c["chunk_id"]: c["n_nodes"] for c in trace["chunks"]} == {c: len(v) for c, v in means.items()}
        assert all({int(index.node_chunk[u]) for u in c["node_ids"]} == {c["chunk_id"]} for c in trace["chunks"])
        assert sorted(u for c in trace["chunks"] for u in c["node_ids"]) == sorted(selected)
        for c in trace["chunks"]:
            assert c["score"] == pytest.approx(np.mean(means[c["chunk_id"]]), abs=1e-6)
        scores = [c["score"] for c in trace["chunks"]]
        assert scores == sorted(scores, reverse=True)
        assert [c["chunk_id"] for c in trace["chunks"][: config.top_k]] == [c for c in result.chunk_ids[b] if c >= 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_n_and_top_k_beyond_the_index_give_what_the_index_has(backend):
    # --n 99999999999 once asked numpy for 2 TiB of seed columns: the result has a column per node
    # and per chunk the index holds, and the same answers as n and top_k at those counts
    index = random_index(4, 300, 16, 3, n_chunks=40)
    queries = queries_for(index, 4, 5)
    beyond = RetrievalConfig(**backend, gamma=0.5, n=99_999_999_999, top_k=1_000_000_000)
    huge = Retriever(index, beyond).search(queries)
    exact = Retriever(index, RetrievalConfig(**backend, gamma=0.5, n=300, top_k=40)).search(queries)
    assert huge.seed_ids.shape == (5, 300) and huge.chunk_ids.shape == (5, 40)
    for name in ("chunk_ids", "seed_ids", "n_selected"):
        np.testing.assert_array_equal(getattr(huge, name), getattr(exact, name))


@pytest.mark.parametrize("read_only", ["nodes", "queries"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_searching_read_only_arrays_warns_of_nothing(tmp_path, backend, read_only):
    """A loaded index's node embeddings are a read-only memory map, and the queries a Ray shard owner
    gets are read-only (its nodes are in memory); torch warned that tensors over them are not writable
    (`qcg query` and the owners printed it). One fresh process a case: torch warns once a process."""
    index = random_index(5, 300, 16, 3, n_chunks=40)
    np.save(tmp_path / "nodes.npy", index.node_embeddings)
    np.save(tmp_path / "queries.npy", queries_for(index, 5, 8))
    np.savez(tmp_path / "graph.npz", indptr=index.knn_indptr, indices=index.knn_indices, chunk=index.node_chunk)
    search = f"""
import numpy as np
from qcg_gpu.retrieval import QCGIndex, RetrievalConfig, Retriever
from qcg_gpu.retrieval.retriever import local_backend
nodes = np.load(r"{tmp_path / "nodes.npy"}", mmap_mode="r" if {read_only!r} == "nodes" else None)
graph = np.load(r"{tmp_path / "graph.npz"}")
index = QCGIndex(None, {{}}, nodes, graph["indptr"], graph["indices"], graph["chunk"], 40)
queries = np.load(r"{tmp_path / "queries.npy"}", mmap_mode="r" if {read_only!r} == "queries" else None)
config = RetrievalConfig(gamma=0.5, **{backend!r})
Retriever(index, config).search(queries)
owners_backend = local_backend(index, config)  # as a shard owner calls it, on the queries as they come
owners_backend.rank(queries, owners_backend.seeds(queries, config)[0], 5)
"""
    run = subprocess.run([sys.executable, "-W", "error", "-c", search], capture_output=True, text=True)
    said = [line for line in run.stderr.splitlines() if "--prefilter bf16 on a CPU without AMX" not in line]
    assert run.returncode == 0 and not said, run.stderr[-2000:]  # the one notice qcg means to give aside
