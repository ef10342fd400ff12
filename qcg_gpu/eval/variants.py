"""Index variants for sweeps and ablations, derived in memory from a built index without any
LLM call: the stored pairs are re-filtered at another ``alpha`` (their Doc2Query-- scores and
embeddings are in the index) or cut to each chunk's first ``max_pairs`` (M smaller than it was
generated with, the LLM's later pairs unasked), re-linked with another kNN degree ``k``, or turned into other
node texts (question only, answer only, or the chunks' sentences, which are embedded anew).

With the index's own settings the variant equals the stored index exactly.
"""

from __future__ import annotations

import copy

import numpy as np

from ..config import GraphConfig, IndexConfig, NodeConfig
from ..embedding import Embedder
from ..errors import QCGError
from ..indexing.knn import knn_graph
from ..indexing.stages import Pairs, build_nodes
from ..retrieval import QCGIndex


def derive_index(
    index: QCGIndex,
    *,
    alpha: float | None = None,
    knn_k: int | None = None,
    nodes: str | None = None,
    max_pairs: int | None = None,
    embedder: Embedder | None = None,
) -> QCGIndex:
    """``index`` rebuilt from its stored pairs with other settings (None keeps the index's own)."""
    settings = copy.deepcopy(index.manifest["settings"])
    alpha = settings["nodes"]["alpha"] if alpha is None else alpha
    knn_k = settings["graph"]["knn_k"] if knn_k is None else knn_k
    nodes = settings["nodes"]["nodes"] if nodes is None else nodes
    NodeConfig(alpha=alpha, nodes=nodes).validate()  # the index builder's own checks and messages
    GraphConfig(knn_k=knn_k).validate()
    own = settings["nodes"]
    if max_pairs is not None and max_pairs < 1:
        raise QCGError(f"max_pairs must be >= 1, got {max_pairs}")
    if nodes == own["nodes"] and (nodes == "sentence" or (alpha == own["alpha"] and max_pairs is None)):
        node_emb, node_chunk = index.node_embeddings, index.node_chunk  # same nodes: only the graph changes
    else:
        node_emb, node_chunk = _rebuild_nodes(index, alpha, nodes, embedder, max_pairs)
    graph_config = IndexConfig.from_dict(settings).graph  # an index from before --knn: exact
    graph = knn_graph(node_emb, knn_k, graph_config.knn_backend, settings["nodes"]["device"], graph_config.probes())

    settings["nodes"].update(alpha=alpha, nodes=nodes)
    settings["graph"]["knn_k"] = knn_k
    manifest = {**index.manifest, "settings": settings, "derived_from": str(index.path)}
    manifest.pop("shards", None)  # it lives in this process: no worker could load it from shard files
    if max_pairs is not None and nodes != "sentence":
        manifest["first_pairs"] = max_pairs  # each chunk's first max_pairs valid pairs, before Doc2Query--
    variant = QCGIndex(
        index.path,
        manifest,
        np.ascontiguousarray(node_emb, dtype=np.float32),
        graph.indptr,
        graph.indices,
        node_chunk,
        index.n_chunks,
        verified=index.verified,
        data=index.data,
    )
    variant.__dict__["chunks"] = index.chunks  # share the cached chunks table
    return variant


def _rebuild_nodes(index: QCGIndex, alpha: float, nodes: str, embedder: Embedder | None, max_pairs: int | None):
    """Nodes and embeddings from the stored pairs (each chunk's first ``max_pairs`` when given)
    re-filtered at ``alpha``, or the chunks' sentences."""
    if nodes != "qa" and embedder is None:
        raise QCGError(f"node text {nodes!r} needs an embedder to embed the new nodes")
    pairs = Pairs.from_table(index.table("pairs"))
    if nodes != "sentence" and not len(pairs):
        raise QCGError(
            f"{index.path} holds no generated pairs (built with --nodes sentence?); only the sentence variant applies"
        )
    pair_emb = np.asarray(index.array("pair_embeddings"), dtype=np.float32)
    if max_pairs is not None:
        first = np.flatnonzero(pairs.gen_index < max_pairs)
        pairs = Pairs(
            pairs.chunk_id[first],
            pairs.gen_index[first],
            [pairs.question[i] for i in first],
            [pairs.answer[i] for i in first],
            score=None if pairs.score is None else pairs.score[first],
        )
        pair_emb = pair_emb[first]
    pairs.select(alpha)
    node_set, node_emb = build_nodes(nodes, index.chunk_texts(), pairs, pair_emb, embedder)
    return node_emb, np.asarray(node_set.chunk_id, dtype=np.int64)
