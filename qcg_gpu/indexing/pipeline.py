"""The index build: documents → chunks → Doc2Query → Doc2Query-- → nodes → kNN graph → disk,
as a sequence over the stage library (``stages.py``, ``generation.py``).

:func:`build_index` is the Python API behind ``qcg index``.
"""

from __future__ import annotations

from pathlib import Path

from ..config import IndexConfig
from ..embedding import Embedder
from ..index_format import check_writable
from ..llm.backends import LLMBackend, llm_name
from ..models import DEFAULT_EMBEDDER, embedding_dim, resolve_model
from .generation import generate_pairs
from .sharded import build_on_cluster
from .stages import (
    IndexSummary,
    Pairs,
    build_graph,
    build_manifest,
    build_shards,
    check_room,
    embed_and_select,
    index_tables,
    load_embedder,
    read_chunks,
    stage,
    write_index,
)


def build_index(
    input_path: str | Path,
    out: str | Path,
    config: IndexConfig | None = None,
    *,
    overwrite: bool = False,
    llm: LLMBackend | None = None,
    embedder: Embedder | None = None,
    cluster=None,
) -> IndexSummary:
    """Build a QCG index of the documents at ``input_path`` into the directory ``out``.

    ``llm`` and ``embedder`` may be passed in to reuse loaded models across builds. With a
    ``cluster`` (:class:`cluster.RayCluster`), the build runs shard by shard on its workers
    (:mod:`sharded`) and gives the same index. Progress goes through the ``qcg_gpu`` logger
    (``log.py``: INFO shows it, WARNING hides it).
    """
    config = (config or IndexConfig()).validate()
    out = Path(out)
    replaces = check_writable(out, overwrite)
    dim = embedder.dim if embedder else None
    if embedder is None:  # a wrong embedder name fails now, not after hours of generation
        dim = embedding_dim(resolve_model(config.nodes.embedder, DEFAULT_EMBEDDER)[0])
    summary = IndexSummary(out=out, replaces=replaces)
    if cluster is not None:
        return build_on_cluster(input_path, out, config, cluster, llm, summary)

    with stage(summary, "chunk", quiet=True):  # its bar says so, once the input is accepted
        chunks = read_chunks(input_path, config, summary)
    check_room(out, chunks, config, dim)  # before any model runs

    pairs, model_name = Pairs.empty(), None
    if config.nodes.nodes != "sentence":
        model_name = llm.model_name if llm else llm_name(config.generation)
        pairs = generate_pairs(chunks, llm, model_name, config, summary)

    with stage(summary, "load_embedder"):
        embedder = embedder or load_embedder(config.nodes)
    windowed_before = embedder.windowed_texts  # a passed-in embedder may have counted other builds' texts
    with stage(summary, "embed"):
        embedded = embed_and_select(chunks, pairs, config.nodes, embedder)
    summary.texts_over_windows = embedder.windowed_texts - windowed_before

    with stage(summary, "knn"):
        graph = build_graph(embedded.node_embeddings, config)

    summary.pairs_valid, summary.pairs_kept = len(pairs), len(pairs.kept_rows())
    summary.nodes, summary.edges = len(embedded.nodes.text), len(graph.indices)
    arrays = {
        "chunk_embeddings": embedded.chunk_embeddings,
        "pair_embeddings": embedded.pair_embeddings.astype(config.nodes.embedding_dtype),
        "node_embeddings": embedded.node_embeddings.astype(config.nodes.embedding_dtype),
    }
    manifest = build_manifest(config, summary, model_name, embedder)
    tables = index_tables(chunks, pairs, embedded.nodes)
    write_index(out, tables, arrays, graph, manifest, summary, build_shards(manifest, embedded.nodes.chunk_id))
    return summary
