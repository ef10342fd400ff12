import os
import subprocess
import sys

import numpy as np
import pytest

from qcg_gpu.capabilities import WITH_FAISS
from qcg_gpu.indexing.knn import knn_graph

from .conftest import KNN_BACKENDS as BACKENDS

needs_faiss = pytest.mark.skipif(not WITH_FAISS, reason="the IVF lists are faiss k-means (the GPU image has no faiss)")


def brute_force(emb: np.ndarray, k: int):
    """Per row: the k best other rows by float64 cosine, ties by lower id (plain Python sort)."""
    emb64 = emb.astype(np.float64)
    rows = []
    for i in range(len(emb)):
        scored = sorted((-float(emb64[i] @ emb64[j]), j) for j in range(len(emb)) if j != i)
        rows.append([j for _, j in scored[:k]])
    return rows


def unit_rows(rng, n, d):
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("n,k", [(300, 2), (300, 5), (40, 39), (40, 60), (2, 1)])
def test_knn_equals_brute_force(backend, device, n, k):
    emb = unit_rows(np.random.default_rng(n + k), n, 24)
    graph = knn_graph(emb, k, backend, device)
    k_eff = min(k, n - 1)
    assert graph.indptr.tolist() == list(range(0, n * k_eff + 1, k_eff))
    assert graph.indices.reshape(n, k_eff).tolist() == brute_force(emb, k_eff)
    expected_scores = np.einsum("ij,ij->i", emb[np.repeat(np.arange(n), k_eff)], emb[graph.indices])
    np.testing.assert_allclose(graph.scores, expected_scores, atol=1e-6)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_ties_break_by_lower_id_even_past_the_candidate_cut(backend, device):
    rng = np.random.default_rng(0)
    base = unit_rows(rng, 5, 16)
    # 30 copies of one vector (ties far beyond k + margin candidates) among distinct ones
    emb = np.concatenate([base[:2], np.repeat(base[2:3], 30, axis=0), base[3:]])
    graph = knn_graph(emb, 3, backend, device)
    assert graph.indices.reshape(len(emb), 3).tolist() == brute_force(emb, 3)
    assert graph.indices[3 * 2 : 3 * 3].tolist() == [3, 4, 5]  # first copy: the next copies by id


def test_all_backends_agree_on_real_embeddings(embedder):
    texts = [f"Li Hua meets friend number {i % 37} at the café on day {i}" for i in range(500)]
    emb = embedder.encode(texts)
    graphs = [knn_graph(emb, 3, backend, device) for backend, device in BACKENDS]
    for other in graphs[1:]:
        np.testing.assert_array_equal(graphs[0].indices, other.indices)
        np.testing.assert_array_equal(graphs[0].scores, other.scores)


def test_degenerate_sizes():
    for n in (0, 1):
        graph = knn_graph(np.zeros((n, 8), np.float32), 2)
        assert graph.indptr.tolist() == [0] * (n + 1) and graph.indices.size == 0


def edge_recall(got, want) -> float:
    n = len(want.indptr) - 1
    found = [len(set(a) & set(b)) for a, b in zip(got.indices.reshape(n, -1), want.indices.reshape(n, -1))]
    return sum(found) / want.indices.size


@needs_faiss
def test_approximate_graph_finds_nearly_every_edge_and_scores_it_exactly(embedder):
    texts = [f"Li Hua meets friend number {i % 37} at the café on day {i}" for i in range(2000)]
    emb = embedder.encode(texts)
    exact = knn_graph(emb, 3)
    approx = knn_graph(emb, 3, probes=16)
    assert approx.indptr.tolist() == exact.indptr.tolist()
    assert edge_recall(approx, exact) >= 0.95
    rows = np.repeat(np.arange(len(emb)), 3)
    want = np.einsum("ij,ij->i", emb[rows].astype(np.float64), emb[approx.indices].astype(np.float64))
    np.testing.assert_array_equal(approx.scores, want.astype(np.float32))  # ranked exactly, like the exact graph
    assert (np.diff(approx.scores.reshape(-1, 3), axis=1) <= 0).all() and (approx.indices != rows).all()


@needs_faiss
def test_a_narrow_approximate_search_misses_edges_and_a_wide_one_finds_them():
    emb = unit_rows(np.random.default_rng(5), 3000, 256)  # isotropic: no clusters for the lists to follow
    exact = knn_graph(emb, 2)
    narrow, wide = (edge_recall(knn_graph(emb, 2, probes=probes), exact) for probes in (1, 1000))
    assert narrow < 0.5 and wide == 1.0  # every list searched: the exact graph


def brute_force_ivf(emb: np.ndarray, centroids: np.ndarray, k: int, probes: int):
    """ivf's definition in plain Python: row i's k best among the nodes whose nearest centroid is one of
    i's ``probes`` nearest (float64, ties by lower id); every other node when those are fewer than k."""
    emb64, cent64 = emb.astype(np.float64), centroids.astype(np.float64)
    probed = [[j for _, j in sorted((-float(x @ c), j) for j, c in enumerate(cent64))[:probes]] for x in emb64]
    rows = []
    for i in range(len(emb)):
        members = [j for j in range(len(emb)) if j != i and probed[j][0] in probed[i]]
        if len(members) < k:
            members = [j for j in range(len(emb)) if j != i]
        rows.append([j for _, j in sorted((-float(emb64[i] @ emb64[j]), j) for j in members)[:k]])
    return rows


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_rows_ranked_block_by_block_are_ranked_as_one_block(backend, device, monkeypatch):
    """best_in ranks RANK_ROWS rows at a time (a shard task's memory does not grow with its rows): the
    same ids and scores as all rows at once, with ties past the candidates and a floor on entry."""
    from qcg_gpu.indexing import ranking

    emb = unit_rows(np.random.default_rng(5), 300, 16)
    emb[40:80] = emb[40]
    row_ids, floor = np.arange(300), np.where(np.arange(300) % 3 == 0, 0.2, -np.inf)
    whole = ranking.best_in(emb, row_ids, emb, row_ids, 6, backend, device, floor)
    monkeypatch.setattr(ranking, "RANK_ROWS", 7)
    blocks = ranking.best_in(emb, row_ids, emb, row_ids, 6, backend, device, floor)
    np.testing.assert_array_equal(blocks[0], whole[0])
    np.testing.assert_array_equal(blocks[1], whole[1])
    assert (whole[0][40, :6] == [41, 42, 43, 44, 45, 46]).all()  # a tie past the candidates: lower ids


def test_ivf_lists_and_their_training_sample_stay_bounded_at_a_billion_nodes():
    """~4 sqrt(N) lists up to 268M nodes (graphs built before the cap are unchanged), then 65,536 lists
    trained on 4.2M rows: 6.4 GB of 384-d embeddings in the one trainer, not 12 GB (issue 36)."""
    from qcg_gpu.indexing.ivf import MAX_LISTS, SAMPLE_PER_LIST, list_count, training_rows

    assert [list_count(n) for n in (400, 10**6, 2.5 * 10**8)] == [10, 4000, 63245]
    assert list_count(10**9) == list_count(4 * 10**8) == MAX_LISTS
    rows = training_rows(10**9)
    assert len(rows) == MAX_LISTS * SAMPLE_PER_LIST == 2**22 and len(np.unique(rows)) == len(rows)
    assert rows[-1] < 10**9 and np.all(np.diff(rows) > 0)


@needs_faiss
@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("k,probes", [(4, 1), (4, 3), (60, 1)])
def test_the_approximate_graph_is_the_ivf_definition(backend, device, k, probes):
    """Lists by exact nearest centroid, members of the probed lists ranked exactly, ties by lower id
    (60 copies of one node), and rows whose lists hold fewer than k others (k = 60) ranked over all."""
    from qcg_gpu.indexing.ivf import graph_lists, graph_rows, ivf_graph, list_count, train_centroids, training_rows

    emb = unit_rows(np.random.default_rng(3), 400, 16)
    emb[200:260] = emb[200]
    centroids = train_centroids(emb[training_rows(400)], list_count(400))
    ids, scores = ivf_graph(emb, k, probes, backend, device, centroids=centroids)
    assert ids.tolist() == brute_force_ivf(emb, centroids, k, probes)
    want = np.einsum(
        "ij,ij->i", emb[np.repeat(np.arange(400), k)].astype(np.float64), emb[ids.ravel()].astype(np.float64)
    )
    np.testing.assert_array_equal(scores.ravel(), want.astype(np.float32))
    # row blocks (a Ray task each in distributed.knn_graph_of_parts), one cut inside the 60 copies
    lists = graph_lists(emb, probes, backend, device, centroids)
    blocks = [graph_rows(emb, a, b, k, lists, backend, device) for a, b in ((0, 7), (7, 230), (230, 400))]
    assert np.array_equal(np.concatenate([b[0] for b in blocks]), ids)
    assert np.array_equal(np.concatenate([b[1] for b in blocks]), scores)


FAISS_OPENBLAS_KERNELS = """
import ctypes
from qcg_gpu.capabilities import _openblas_family, require
require("faiss")
[path] = {line.split()[-1] for line in open("/proc/self/maps") if "faiss" in line and "libopenblas" in line}
name = ctypes.CDLL(path).openblas_get_corename
name.restype = ctypes.c_char_p
print(_openblas_family(), name().decode())
"""


@pytest.mark.skipif(not WITH_FAISS, reason="faiss is not installed")
@pytest.mark.skipif(sys.platform != "linux", reason="reads the CPU's flags and the loaded libraries from /proc")
def test_faiss_s_openblas_runs_this_cpu_s_kernels():
    """faiss-cpu's OpenBLAS (0.3.15) took this Emerald Rapids Xeon for a Prescott, and its exact searches
    ran 4x slower on SSE3 kernels."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    run = subprocess.run([sys.executable, "-c", FAISS_OPENBLAS_KERNELS], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    family, kernels = run.stdout.split()
    if family == "None":
        pytest.skip("a CPU without AVX2: OpenBLAS picks its kernels itself")
    assert kernels.lower() == family.lower()
