"""``qcg bench`` on real components: faiss, numba and torch retrieval, the real embedder and vLLM."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qcg_gpu.cli import main
from qcg_gpu.config import IndexConfig, RetrievalConfig
from qcg_gpu.eval import bench
from qcg_gpu.eval.bench import BenchConfig
from qcg_gpu.retrieval import Retriever, seed_threshold

from .conftest import sample_docs
from .reference import reference_search

# Two values closer than this may be ordered either way by float32 GEMMs and sums: each is off by at most
# d 2^-24 |q| |u| ~ 2.3e-5 at d = 384 (the routes rank by float32 values, our engine by float64 ones).
TIE = 5e-5


def near_tie(index, query, config) -> bool:
    """Whether a query's exact (float64) numbers leave its seeds or top-K chunks to float32 rounding: a node
    within TIE of the threshold or of the n-th seed, or two of the K + 1 best chunk means within TIE."""
    sims = index.node_embeddings.astype(np.float64) @ query.astype(np.float64)
    threshold = float(seed_threshold(config.gamma))
    above = np.sort(sims[sims >= threshold])[::-1]
    if np.any(np.abs(sims - threshold) < TIE) or (
        len(above) > config.n and above[config.n - 1] - above[config.n] < TIE
    ):
        return True
    graph = (index.node_embeddings, index.knn_indptr, index.knn_indices, index.node_chunk)
    *_, means = reference_search(*graph, query, config.gamma, config.n, config.hops, index.n_chunks)
    return bool(np.any(-np.diff(means[: config.top_k + 1]) < TIE))


def test_the_routes_a_user_would_write_find_our_chunks():
    """Every query whose exact numbers are not a near-tie gets the same chunks from our engine, the faiss
    library route, the torch topk route and the float64 reference; near-ties are few."""
    index = bench.synthetic_index(3000)
    queries = bench.synthetic_queries(index, 300)
    config = RetrievalConfig(gamma=1.5, n=10, hops=1, top_k=5)
    ours = [[c for c in row if c >= 0] for row in Retriever(index, config).search(queries).chunk_ids.tolist()]
    ties = [near_tie(index, q, config) for q in queries]
    graph = (index.node_embeddings, index.knn_indptr, index.knn_indices, index.node_chunk)
    exact = [reference_search(*graph, q, config.gamma, config.n, config.hops, config.top_k)[2] for q in queries]
    routes = [route.search(queries, config) for route in (bench.LibraryRoute(index), bench.TopkRoute(index))]
    for q in range(len(queries)):
        if not ties[q]:
            assert ours[q] == exact[q] == routes[0][q] == routes[1][q], q
    assert sum(ties) < 0.15 * len(queries)  # the comparison covers most queries (27 of 300 are near-ties)
    assert sum(map(len, ours)) > 3 * len(queries)  # the queries find seeds: the comparison is not of empty lists


def test_qcg_bench_prints_tables_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--parts", "retrieval,knn,embedding", "--nodes", "4000", "--batch", "200,400"]
    assert main(argv + ["--backends", "numpy,torch", "--repeat", "1", "--texts", "64", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    retrieval = [r for r in rows if r["part"] == "retrieval"]
    assert [(r["backend"], r["batch"]) for r in retrieval] == [
        ("numpy", 200),
        ("numpy", 400),
        ("torch", 200),
        ("torch", 400),
    ]
    for r in retrieval:
        assert min(r["queries_per_s"], r["library_queries_per_s"], r["topk_queries_per_s"]) > 0
        agree, total = map(int, r["equal_to_library"].split(" of "))
        assert total == r["batch"] and agree >= 0.98 * total
    (knn,) = [r for r in rows if r["part"] == "knn"]
    assert knn["nodes"] == 4000 and knn["edge_recall"] > 0.9 and knn["exact_build_s"] is not None
    assert {r["texts"] for r in rows if r["part"] == "embedding"} == {"short", "long"}
    assert all(r["cpu"] for r in rows)
    printed = capsys.readouterr()
    assert "### retrieval" in printed.out and "### knn" in printed.out and "### embedding" in printed.out
    assert printed.out.startswith("machine: ")  # the tables alone: each row went to stderr as it was measured
    progress = [json.loads(line.removeprefix("[qcg] ")) for line in printed.err.splitlines() if "{" in line]
    assert progress == [{k: v for k, v in r.items() if k != "cpu"} for r in rows]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--parts", "retrieval,speed"], "unknown bench part(s) ['speed']"),
        (["--parts", "doc2query"], "the doc2query part needs --docs"),
        (["--nodes", "10k"], "--nodes takes comma-separated integers"),
        (["--batch", "0"], "--nodes and --batch must be positive"),
        (["--texts", "0"], "--texts (texts) must be >= 1, got 0"),  # measured 0 texts and printed the row
        (["--limit", "0"], "--limit (limit) must be >= 1, got 0"),
        (["--repeat", "0"], "--repeat (repeat) must be >= 1, got 0"),
    ],
)
def test_bad_bench_options_are_refused_in_one_line(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.llm
def test_doc2query_is_measured_against_the_bare_engine(tmp_path, vllm_backend):
    docs = sample_docs(tmp_path / "docs", 2)
    config = BenchConfig(parts="doc2query", docs=str(docs), limit=2, repeat=1)
    settings = IndexConfig()
    settings.generation.m = 2
    (row,) = bench.doc2query_rows(config.validate(), settings, vllm_backend)
    assert row["chunks"] == 2 and row["llm"] == vllm_backend.model_name
    assert row["engine_output_tok_per_s"] > 0 and row["bare_output_tok_per_s"] > 0
    assert np.isclose(row["engine_over_bare"], row["engine_output_tok_per_s"] / row["bare_output_tok_per_s"], rtol=0.01)


def test_bench_takes_the_config_files_knn_and_doc2query_settings_below_the_options_given(tmp_path):
    """qcg bench reads a build's settings in a build's order (defaults < config file < options): the kNN
    part's k and probes, and the doc2query part's model and M."""
    from qcg_gpu.cli import parse_arguments
    from qcg_gpu.cli.index import index_config

    config = tmp_path / "qcg.toml"
    config.write_text('[graph]\nknn_k = 3\nknn_probes = 2\n\n[generation]\nm = 6\nmodel = "qwen2.5-coder-1.5b"\n')
    out = tmp_path / "bench.json"
    argv = ["--config", str(config), "bench", "--parts", "knn", "--nodes", "600", "--repeat", "1", "--json", str(out)]
    assert main(argv) == 0
    (row,) = json.loads(out.read_text())
    assert (row["k"], row["probes"]) == (3, 2)
    assert main([*argv, "--knn-probes", "4", "--knn-k", "1"]) == 0
    (row,) = json.loads(out.read_text())
    assert (row["k"], row["probes"]) == (1, 4)
    settings = index_config(parse_arguments(["--config", str(config), "bench", "--parts", "doc2query", "--m", "5"]))
    assert (settings.generation.model, settings.generation.m) == ("qwen2.5-coder-1.5b", 5)
