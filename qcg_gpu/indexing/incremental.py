"""Add documents to an index, or remove them, without rebuilding it.

Adding generates pairs only for the new chunks, embeds only new texts, appends chunks, pairs and
nodes after the existing ones (existing ids do not change) and updates the kNN graph with
:func:`qcg_gpu.indexing.knn.add_nodes` (new rows searched over all nodes; an old row is re-ranked only
when a new node enters its k nearest). Removing drops a document's chunks, pairs and nodes,
renumbers the rest in order and re-searches only the rows that lost an out-neighbour
(:func:`qcg_gpu.indexing.knn.remove_nodes`). Either way the result equals a full rebuild over the same
documents in the same order, and it is published as a new index version (readers are never
disturbed; a failure leaves the index as it was). The index's own settings are used; options
that would change results must match them.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..config import IndexConfig, result_fields
from ..embedding import Embedder
from ..errors import QCGError
from ..index_format import update_lock
from ..llm.backends import LLMBackend
from ..retrieval import QCGIndex
from .chunking import Chunk
from .generation import generate_pairs
from .knn import KnnGraph, add_nodes, remove_nodes
from .stages import (
    IndexSummary,
    Pairs,
    chunk_ranges,
    embed_and_select,
    index_tables,
    llm_reproducibility,
    load_embedder,
    package_versions,
    range_ids,
    read_chunks,
    stage,
    write_index,
)

ARRAYS = ("chunk_embeddings", "pair_embeddings", "node_embeddings")


@dataclasses.dataclass
class _Stored:
    """Everything of an index version that an update rewrites (as published, or as updated in memory)."""

    manifest: dict
    tables: dict  # name -> pyarrow Table
    arrays: dict  # name -> np.ndarray
    graph: KnnGraph

    @classmethod
    def load(cls, path: Path) -> _Stored:
        index = QCGIndex.load(path)
        tables = {name: index.table(name) for name in ("chunks", "pairs", "nodes")}
        arrays = {name: np.asarray(index.array(name)) for name in ARRAYS}
        graph = KnnGraph(index.knn_indptr, index.knn_indices, np.asarray(index.array("knn_scores")))
        return cls(index.manifest, tables, arrays, graph)

    def doc_ids(self) -> np.ndarray:
        return np.array(self.tables["chunks"].column("doc_id").to_pylist(), dtype=object)


def index_settings(manifest: dict, options: IndexConfig | None) -> IndexConfig:
    """The index's settings, with the runtime options of ``options``; any other option given that
    differs from both its default and the index's value is refused (it would change results)."""
    config = IndexConfig.from_dict(manifest["settings"])
    if options is None:
        return config
    defaults, conflicts = IndexConfig(), []
    for name in IndexConfig.SECTIONS:
        stored, given, default = getattr(config, name), getattr(options, name), getattr(defaults, name)
        results = result_fields(stored)
        for f in dataclasses.fields(stored):
            value = getattr(given, f.name)
            if f.name not in results:  # how to run: the caller's
                setattr(stored, f.name, value)
            elif value != getattr(default, f.name) and value != getattr(stored, f.name):
                conflicts.append(f"{f.name}={value!r} (the index has {getattr(stored, f.name)!r})")
    if conflicts:
        raise QCGError("an update must use the index's own settings; drop " + ", ".join(conflicts))
    return config.validate()


def add_documents(
    index: str | Path,
    input_path: str | Path,
    options: IndexConfig | None = None,
    *,
    llm: LLMBackend | None = None,
    embedder: Embedder | None = None,
    cluster=None,
) -> IndexSummary:
    """Add the documents at ``input_path`` (directory, .jsonl or .parquet) to an existing index;
    with a Ray ``cluster``, the new chunks' pairs and embeddings are made on its workers."""
    index = Path(index)
    with update_lock(index):
        stored = _Stored.load(index)
        config = index_settings(stored.manifest, options)
        summary = IndexSummary(out=index)
        with stage(summary, "chunk"):
            chunks = read_chunks(input_path, config, summary)
        clash = sorted({c.doc_id for c in chunks} & set(stored.doc_ids()))
        if clash:
            raise QCGError(
                f"{len(clash)} documents are in the index already (remove them first to replace them): {clash[:5]}"
            )
        updated = _with_chunks(stored, chunks, config, summary, llm, embedder, cluster)
        change = {"op": "add", "documents": summary.documents, "chunks": len(chunks)}
        change |= _batch_record(int(stored.manifest["counts"]["chunks"]), len(chunks), config, summary)
        _publish(index, updated, summary, change)
    return summary


def remove_documents(index: str | Path, doc_ids: list[str]) -> IndexSummary:
    """Remove the documents ``doc_ids`` (their chunks, pairs and nodes) from an index."""
    index = Path(index)
    with update_lock(index):
        stored = _Stored.load(index)
        summary = IndexSummary(out=index)
        updated = _without_documents(stored, doc_ids, IndexConfig.from_dict(stored.manifest["settings"]), summary)
        _publish(index, updated, summary, {"op": "remove", "documents": sorted(set(doc_ids))})
    return summary


def retry_failed(
    index: str | Path,
    options: IndexConfig | None = None,
    *,
    llm: LLMBackend | None = None,
    embedder: Embedder | None = None,
    cluster=None,
) -> IndexSummary:
    """Generate the chunks whose LLM request failed, then update the index like ``add``: the
    documents they belong to are taken out and added back (their other chunks' replies come from
    the cache), so the index equals a rebuild with those documents last. Nothing is read from
    the input: the chunks are in the index. If a chunk fails again, the index stays as it was."""
    index = Path(index)
    with update_lock(index):
        stored = _Stored.load(index)
        config = index_settings(stored.manifest, options)
        summary = IndexSummary(out=index)
        failed = failed_documents(stored.manifest, stored.tables["chunks"])
        if not failed:
            raise QCGError(f"{index} has no failed chunks: nothing to retry")
        rows = stored.tables["chunks"].filter(pa.array(np.isin(stored.doc_ids(), list(failed)))).to_pylist()
        chunks = [Chunk(r["doc_id"], r["chunk_index"], r["n_tokens"], r["text"]) for r in rows]
        summary.documents, summary.chunks = len(failed), len(chunks)
        remaining = _without_documents(stored, list(failed), config, IndexSummary(out=index))
        updated = _with_chunks(remaining, chunks, config, summary, llm, embedder, cluster)
        change = {"op": "retry", "documents": sorted(failed)}
        change |= _batch_record(remaining.tables["chunks"].num_rows, len(chunks), config, summary)
        _publish(index, updated, summary, change)
    return summary


def _batch_record(first: int, count: int, config: IndexConfig, summary: IndexSummary) -> dict:
    """What an add or a retry records of its chunks: their ids (appended, generated beside each other,
    not beside the rest), those whose reply an earlier run made, and what generated the others."""
    record: dict = {"chunk_ids": [first, first + count]}
    record["replies_from_earlier_runs"] = [[first + a, first + b] for a, b in summary.earlier_replies]
    if config.nodes.nodes != "sentence":
        record["llm_reproducibility"] = llm_reproducibility(summary)
    return record


def failed_documents(manifest: dict, chunks: pa.Table) -> dict[str, str]:
    """Each document with a chunk whose LLM request failed, and the first error: its status."""
    doc_ids = chunks.column("doc_id").to_pylist()
    failed: dict[str, str] = {}
    for chunk_id, error in manifest.get("failed_chunks", []):
        failed.setdefault(doc_ids[chunk_id], error)
    return failed


def _with_chunks(
    stored: _Stored,
    chunks: list[Chunk],
    config: IndexConfig,
    summary: IndexSummary,
    llm: LLMBackend | None,
    embedder: Embedder | None,
    cluster,
) -> _Stored:
    """``stored`` with ``chunks`` appended: their pairs generated (cached ones reused), their texts
    embedded and selected, their nodes added to the kNN graph. Refused, changing nothing, when a
    chunk gets no LLM reply."""
    manifest = stored.manifest
    pairs = Pairs.empty()
    if config.nodes.nodes != "sentence":
        model_name = manifest["models"]["llm"]
        if cluster is not None:
            from .distributed import ray_llm

            llm = llm or ray_llm(cluster, config.generation)
        if llm is not None and llm.model_name != model_name:
            raise QCGError(f"the index's pairs come from {model_name}; got an LLM serving {llm.model_name}")
        pairs = generate_pairs(chunks, llm, model_name, config, summary)
    if summary.failed_chunks:
        raise QCGError(
            f"{len(summary.failed_chunks)} chunks got no LLM reply ({summary.failed_chunks[0][1]}); "
            "the index is unchanged; rerun to retry (replies made so far are cached)"
        )

    with stage(summary, "load_embedder"):
        embedder = embedder or load_embedder(config.nodes, cluster)
    if embedder.model_name != manifest["models"]["embedder"]:
        raise QCGError(f"the index was embedded with {manifest['models']['embedder']}, not {embedder.model_name}")
    if embedder.batch_size != config.nodes.embed_batch_size:  # the batch shape decides an embedding's last bits
        raise QCGError(
            f"the index was embedded in batches of {config.nodes.embed_batch_size} texts; this embedder uses "
            f"{embedder.batch_size}"
        )
    with stage(summary, "embed"):
        embedded = embed_and_select(chunks, pairs, config.nodes, embedder)
    with stage(summary, "knn"):
        graph = add_nodes(
            stored.graph,
            np.asarray(stored.arrays["node_embeddings"], np.float32),
            embedded.node_embeddings,
            config.graph.knn_k,
            config.graph.knn_backend,
            config.nodes.device,
        )

    counts = {name: table.num_rows for name, table in stored.tables.items()}
    new_tables = index_tables(chunks, pairs, embedded.nodes, counts["chunks"], counts["pairs"], counts["nodes"])
    tables = {name: pa.concat_tables([stored.tables[name], new_tables[name]]) for name in stored.tables}
    new_arrays = {
        "chunk_embeddings": embedded.chunk_embeddings,
        "pair_embeddings": embedded.pair_embeddings,
        "node_embeddings": embedded.node_embeddings,
    }
    arrays = {name: np.concatenate([old, new_arrays[name].astype(old.dtype)]) for name, old in stored.arrays.items()}
    summary.pairs_valid, summary.pairs_kept = len(pairs), len(pairs.kept_rows())
    summary.nodes, summary.edges = len(embedded.nodes.text), len(graph.indices)
    counted = {
        **manifest["counts"],
        "pairs_dropped": dict(Counter(manifest["counts"].get("pairs_dropped", {})) + summary.dropped),
    }
    return _Stored({**manifest, "counts": counted}, tables, arrays, graph)


def _without_documents(stored: _Stored, doc_ids: list[str], config: IndexConfig, summary: IndexSummary) -> _Stored:
    """``stored`` without the documents ``doc_ids``: the rest renumbered in order, the graph rows
    that lost an out-neighbour searched again."""
    chunk_docs = stored.doc_ids()
    unknown = sorted(set(doc_ids) - set(chunk_docs))
    if unknown:
        raise QCGError(f"{len(unknown)} documents are not in the index: {unknown[:5]}")
    keep_chunk = ~np.isin(chunk_docs, list(doc_ids))
    if not keep_chunk.any():
        raise QCGError("removing every document would leave an empty index; delete the directory instead")
    new_chunk = np.cumsum(keep_chunk) - 1
    pair_chunk = stored.tables["pairs"].column("chunk_id").to_numpy()
    keep_pair = keep_chunk[pair_chunk]
    new_pair = np.cumsum(keep_pair) - 1
    keep_node = keep_chunk[stored.tables["nodes"].column("chunk_id").to_numpy()]

    with stage(summary, "knn"):
        graph = remove_nodes(
            stored.graph,
            np.asarray(stored.arrays["node_embeddings"], np.float32),
            keep_node,
            config.graph.knn_k,
            config.graph.knn_backend,
            config.nodes.device,
        )
    chunks = stored.tables["chunks"].filter(pa.array(keep_chunk))
    chunks = chunks.set_column(0, "chunk_id", pa.array(np.arange(chunks.num_rows), pa.int64()))
    pairs = stored.tables["pairs"].filter(pa.array(keep_pair))
    pairs = pairs.set_column(0, "chunk_id", pa.array(new_chunk[pairs.column("chunk_id").to_numpy()], pa.int64()))
    nodes = stored.tables["nodes"].filter(pa.array(keep_node))
    sources = nodes.column("source_index").to_numpy()
    nodes = nodes.set_column(0, "node_id", pa.array(np.arange(nodes.num_rows), pa.int64()))
    nodes = nodes.set_column(1, "chunk_id", pa.array(new_chunk[nodes.column("chunk_id").to_numpy()], pa.int64()))
    if config.nodes.nodes != "sentence":  # pair nodes name pairs.parquet rows, which moved
        nodes = nodes.set_column(2, "source_index", pa.array(new_pair[sources], pa.int64()))
    keep = {"chunk_embeddings": keep_chunk, "pair_embeddings": keep_pair, "node_embeddings": keep_node}
    arrays = {name: stored.arrays[name][keep[name]] for name in ARRAYS}
    summary.documents, summary.chunks = len(set(doc_ids)), int((~keep_chunk).sum())
    summary.pairs_valid, summary.nodes = int((~keep_pair).sum()), int((~keep_node).sum())  # removed
    failed = [[int(new_chunk[c]), error] for c, error in stored.manifest.get("failed_chunks", []) if keep_chunk[c]]
    manifest = {**stored.manifest, "failed_chunks": failed}  # renumbered like the chunks
    if "replies_from_earlier_runs" in manifest:  # absent from indexes built before it was recorded
        earlier = range_ids(manifest["replies_from_earlier_runs"])
        manifest["replies_from_earlier_runs"] = chunk_ranges(new_chunk[earlier[keep_chunk[earlier]]])
    return _Stored(manifest, {"chunks": chunks, "pairs": pairs, "nodes": nodes}, arrays, graph)


def _publish(index: Path, stored: _Stored, summary: IndexSummary, change: dict) -> None:
    """Write the updated index as a new version and publish it; counts are taken from what is written."""
    manifest, tables, graph = stored.manifest, stored.tables, stored.graph
    chunks = tables["chunks"]
    pair_modes = manifest["settings"]["nodes"]["nodes"] != "sentence"
    counts = {
        **manifest["counts"],
        "documents": len(set(chunks.column("doc_id").to_pylist())),
        "chunks": chunks.num_rows,
        "pairs_valid": tables["pairs"].num_rows,
        "pairs_kept": int(np.asarray(tables["pairs"].column("kept")).sum()),  # pairs_dropped: over every generation
        "nodes": tables["nodes"].num_rows,
        "knn_edges": len(graph.indices),
        "chunks_without_pairs": int((np.asarray(chunks.column("n_pairs")) == 0).sum()) if pair_modes else 0,
        "chunks_failed": len(manifest.get("failed_chunks", [])),
    }
    tokens, now = manifest.get("llm_tokens", {}), time.time()
    updated = {
        **manifest,
        "updated_unix": now,
        "counts": counts,
        "failed_documents": failed_documents(manifest, chunks),
        "llm_tokens": {  # spent over the index's history
            "prompt": tokens.get("prompt", 0) + summary.prompt_tokens,
            "output": tokens.get("output", 0) + summary.output_tokens,
            "generated_output_this_run": summary.generated_output_tokens,
        },
        "stage_seconds": summary.seconds,
        "skipped": manifest.get("skipped", []) + summary.skipped,
        "history": manifest.get("history", []) + [{**change, "unix": now}],
        "versions": package_versions(),
    }
    for key in ("format_version", "data_dir", "files"):
        updated.pop(key, None)
    write_index(index, tables, stored.arrays, graph, updated, summary, tables["nodes"].column("chunk_id").to_numpy())
