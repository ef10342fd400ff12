"""Incremental kNN: adding and removing nodes gives the graph a full rebuild gives."""

import numpy as np
import pytest

from qcg_gpu.indexing.knn import add_nodes, knn_graph, remove_nodes

from .conftest import KNN_BACKENDS


def clustered(seed: int, n: int, dim: int = 24) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((6, dim))
    x = centers[rng.integers(0, 6, n)] + 0.5 * rng.standard_normal((n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def assert_same_graph(got, want):
    np.testing.assert_array_equal(got.indptr, want.indptr)
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_array_equal(got.scores, want.scores)


@pytest.mark.parametrize("backend, device", KNN_BACKENDS)
@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("n_new", [1, 40, 700])
def test_adding_nodes_equals_a_rebuild(backend, device, k, n_new):
    x = clustered(k * 1000 + n_new, 900 + n_new)
    old, new = x[:900], x[900:]
    got = add_nodes(knn_graph(old, k, backend, device), old, new, k, backend, device)
    assert_same_graph(got, knn_graph(x, k, backend, device))


def test_adding_nodes_repairs_old_rows_and_keeps_the_rest():
    x = clustered(3, 1000)
    old, new = x[:950], x[950:]
    before = knn_graph(old, 2)
    after = add_nodes(before, old, new, 2)
    changed = (after.indices[: 950 * 2] != before.indices).reshape(950, 2).any(axis=1)
    assert 0 < changed.sum() < 950  # some old rows gained a new neighbour, most did not
    assert (after.indices[: 950 * 2].reshape(950, 2)[changed] >= 950).any(axis=1).all()


def test_exact_duplicates_added_break_ties_like_a_rebuild():
    x = clustered(4, 300)
    new = np.vstack([x[:5], x[:5]])  # duplicates of old nodes: exact ties, broken by lower id
    got = add_nodes(knn_graph(x, 3), x, new, 3)
    assert_same_graph(got, knn_graph(np.vstack([x, new]), 3))


@pytest.mark.parametrize("backend, device", KNN_BACKENDS)
@pytest.mark.parametrize("k", [1, 3])
def test_removing_nodes_equals_a_rebuild(backend, device, k):
    x = clustered(7 + k, 1200)
    keep = np.ones(len(x), bool)
    keep[np.random.default_rng(k).choice(len(x), 150, replace=False)] = False
    keep[:30] = False
    got = remove_nodes(knn_graph(x, k, backend, device), x, keep, k, backend, device)
    assert_same_graph(got, knn_graph(x[keep], k, backend, device))


def test_tiny_graphs_grow_and_shrink():
    x = clustered(9, 6)
    for n_old in range(0, 5):
        old, new = x[:n_old], x[n_old:]
        assert_same_graph(add_nodes(knn_graph(old, 3), old, new, 3), knn_graph(x, 3))
    keep = np.array([True, False, False, False, True, False])
    assert_same_graph(remove_nodes(knn_graph(x, 3), x, keep, 3), knn_graph(x[keep], 3))


def test_updates_of_an_approximate_graph_search_their_rows_exactly():
    emb = clustered(3, 1200)
    old, new = emb[:1000], emb[1000:]
    approx = knn_graph(old, 2, probes=1)
    grown = add_nodes(approx, old, new, 2)
    exact = knn_graph(emb, 2).indices.reshape(len(emb), 2)
    rows = grown.indices.reshape(len(emb), 2)
    np.testing.assert_array_equal(rows[len(old) :], exact[len(old) :])  # new rows: searched over every node
    assert (grown.scores.reshape(-1, 2)[: len(old), -1] >= approx.scores.reshape(-1, 2)[:, -1]).all()

    keep = np.arange(len(emb)) % 3 > 0
    shrunk = remove_nodes(grown, emb, keep, 2).indices.reshape(-1, 2)
    lost = ~keep[rows[keep]].all(axis=1)  # kept rows that lost an out-neighbour: searched again, exactly
    assert lost.sum() > 100
    np.testing.assert_array_equal(shrunk[lost], knn_graph(emb[keep], 2).indices.reshape(-1, 2)[lost])
