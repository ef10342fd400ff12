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

An index stored as node shards (``--shard-nodes``) may be larger than one machine, so an add does not
load it: the new chunks become new shards after the old ones, whose files the new version keeps as
they are (hard links) but for their kNN rows, grown one shard at a time (:func:`knn.grow_shards`). A
remove rewrites it one shard at a time (:mod:`shard_removal`), and a retry does both in one version.
Its shards are then cut differently from a rebuild's; its ids, rows and graph are the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..config import IndexConfig, result_fields
from ..embedding import Embedder
from ..errors import QCGError
from ..index_format import (
    ArrayParts,
    IndexWriter,
    data_dir,
    index_shards,
    load_shard_table,
    load_table,
    plan_added_shards,
    read_index_manifest,
    update_lock,
)
from ..llm.backends import LLMBackend
from ..log import counted
from ..retrieval import QCGIndex
from .chunking import Chunk
from .generation import generate_pairs
from .knn import KnnGraph, add_nodes, grow_shards, remove_nodes
from .ranking import degree
from .shard_removal import EMBEDDINGS, Renumbering, keeps_degree, kept_embeddings, kept_tables, write_kept_rows
from .stages import (
    OVER_CONTEXT_ADVICE,
    Embedded,
    IndexSummary,
    Pairs,
    build_shards,
    chunk_ranges,
    embed_and_select,
    index_tables,
    llm_reproducibility,
    load_embedder,
    over_context,
    package_versions,
    range_ids,
    read_chunks,
    stage,
    write_index,
)

ARRAYS = ("chunk_embeddings", "pair_embeddings", "node_embeddings")


@dataclasses.dataclass
class Additions:
    """What an add appends: the new chunks, their pairs, and their texts embedded and selected into nodes."""

    chunks: list[Chunk]
    pairs: Pairs
    embedded: Embedded

    def tables(self, first_chunk: int, first_pair: int, first_node: int) -> dict:
        """Their rows of the index's tables, numbered after the index's own."""
        return index_tables(self.chunks, self.pairs, self.embedded.nodes, first_chunk, first_pair, first_node)


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


@contextlib.contextmanager
def _locked_manifest(index: Path):
    """The index's manifest, read under its update lock; a path that holds no index is refused in one
    line before a lock file is made in it."""
    read_index_manifest(index)
    with update_lock(index):
        yield read_index_manifest(index)


def refuse_known_documents(index: Path, manifest: dict, chunks: list[Chunk]) -> pa.Table:
    """The doc_id column of the index's chunks; an add may not bring a document the index holds already
    (it would be there twice)."""
    doc_ids = load_table(index, "chunks", manifest, columns=["doc_id"])  # not the texts: the index may be huge
    clash = sorted({c.doc_id for c in chunks} & set(doc_ids.column("doc_id").to_pylist()))
    if clash:
        raise QCGError(
            f"the index holds {counted(len(clash), 'document')} of this input already (remove before adding "
            f"again): {clash[:5]}"
        )
    return doc_ids


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
    with _locked_manifest(index) as manifest:
        config = index_settings(manifest, options)
        summary = IndexSummary(out=index)
        with stage(summary, "chunk", quiet=True):  # its bar says so, once the input is accepted
            chunks = read_chunks(input_path, config, summary)
        doc_ids = refuse_known_documents(index, manifest, chunks)
        added = _new_nodes(manifest, chunks, config, summary, llm, embedder, cluster)
        change = {"op": "add", "documents": summary.documents, "chunks": len(chunks)}
        change |= _batch_record(int(manifest["counts"]["chunks"]), len(chunks), config, summary)
        publish_added(index, manifest, doc_ids, added, config, summary, change, cluster)
    return summary


def publish_added(
    index: Path,
    manifest: dict,
    doc_ids: pa.Table,
    added: Additions,
    config: IndexConfig,
    summary: IndexSummary,
    change: dict,
    cluster=None,
) -> None:
    """Publish ``index`` (``manifest``'s version; ``doc_ids``: its chunks' doc_id column) with ``added``
    appended: as new shards of a sharded index, without loading it (a Ray ``cluster`` grows the kNN rows,
    a task per shard); else loaded whole, as one shard."""
    if adds_shards(manifest, len(added.embedded.node_embeddings), config.graph.knn_k):
        _publish_new_shards(index, manifest, doc_ids, added, config, summary, change, cluster)
    else:
        _publish(index, _with_nodes(_Stored.load(index), added, config, summary), summary, change)


def remove_documents(index: str | Path, doc_ids: list[str], cluster=None) -> IndexSummary:
    """Remove the documents ``doc_ids`` (their chunks, pairs and nodes) from an index; a Ray ``cluster``
    searches the kNN rows of a sharded index, a task per shard."""
    if isinstance(doc_ids, str) or not doc_ids:  # a string would be removed letter by letter
        raise QCGError(f"give the ids of the documents to remove as a list, not {doc_ids!r}")
    index = Path(index)
    with _locked_manifest(index) as manifest:
        config, summary = IndexConfig.from_dict(manifest["settings"]), IndexSummary(out=index)
        change = {"op": "remove", "documents": sorted(set(doc_ids))}
        keep_chunk = _kept_chunks(load_table(index, "chunks", manifest, columns=["doc_id"]), doc_ids)
        if not keep_chunk.any():
            raise QCGError("removing every document would leave an empty index; delete the directory instead")
        if len(index_shards(manifest)) > 1:
            ids = Renumbering.keeping(keep_chunk, *(_chunk_ids(index, manifest, name) for name in ("pairs", "nodes")))
            if keeps_degree(ids, config.graph.knn_k):
                _publish_kept_shards(index, manifest, ids, config, summary, change, cluster=cluster)
                return summary
        stored = _Stored.load(index)
        _publish(index, _without_documents(stored, keep_chunk, doc_ids, config, summary), summary, change)
    return summary


def _chunk_ids(index: Path, manifest: dict, table: str) -> np.ndarray:
    """The chunk_id column of a table of the index (one column, shard by shard)."""
    return load_table(index, table, manifest, columns=["chunk_id"]).column("chunk_id").to_numpy()


def _kept_chunks(chunk_docs: pa.Table, doc_ids: list[str]) -> np.ndarray:
    """Which chunks stay once ``doc_ids`` are removed (``chunk_docs``: the doc_id column of the chunks table);
    refused for a document the index does not hold."""
    column, removed = chunk_docs.column("doc_id"), pa.array(list(doc_ids), pa.string())
    unknown = sorted(set(doc_ids) - set(pc.unique(column).to_pylist()))
    if unknown:
        raise QCGError(f"not in the index: {counted(len(unknown), 'document')}, {unknown[:5]}")
    return ~pc.is_in(column, value_set=removed).to_numpy()


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
    with _locked_manifest(index) as manifest:
        config = index_settings(manifest, options)
        summary = IndexSummary(out=index)
        chunk_docs = load_table(index, "chunks", manifest, columns=["doc_id"])  # not the texts: the index may be huge
        failed = failed_documents(manifest, chunk_docs)
        if not failed:
            raise QCGError(f"{index} has no failed chunks: nothing to retry")
        keep_chunk = _kept_chunks(chunk_docs, list(failed))  # none when every document failed: a rebuild
        chunks = _chunks_of(index, manifest, ~keep_chunk)
        summary.documents, summary.chunks = len(failed), len(chunks)
        added = _new_nodes(manifest, chunks, config, summary, llm, embedder, cluster)
        change = {"op": "retry", "documents": sorted(failed)}
        change |= _batch_record(int(keep_chunk.sum()), len(chunks), config, summary)
        if len(index_shards(manifest)) > 1:
            ids = Renumbering.keeping(keep_chunk, *(_chunk_ids(index, manifest, name) for name in ("pairs", "nodes")))
            n_kept, k = int((ids.nodes >= 0).sum()), config.graph.knn_k
            if keeps_degree(ids, k) and degree(k, n_kept) == degree(k, n_kept + len(added.embedded.node_embeddings)):
                _publish_kept_shards(index, manifest, ids, config, summary, change, added, cluster)
                return summary
        remaining = _without_documents(_Stored.load(index), keep_chunk, list(failed), config, IndexSummary(out=index))
        _publish(index, _with_nodes(remaining, added, config, summary), summary, change)
    return summary


def _chunks_of(index: Path, manifest: dict, wanted: np.ndarray) -> list[Chunk]:
    """The chunks ``wanted`` marks, read from the index (of a sharded one, from the shards that hold them)."""
    shards = index_shards(manifest)
    if shards:
        parts = [
            load_shard_table(index, manifest, shard, "chunks").filter(pa.array(wanted[slice(*shard.chunks)]))
            for shard in shards
            if wanted[slice(*shard.chunks)].any()
        ]
        rows = pa.concat_tables(parts).to_pylist()
    else:
        rows = load_table(index, "chunks", manifest).filter(pa.array(wanted)).to_pylist()
    return [Chunk(r["doc_id"], r["chunk_index"], r["n_tokens"], r["text"]) for r in rows]


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


def adds_shards(manifest: dict, new_nodes: int, k: int) -> bool:
    """Whether an add of ``new_nodes`` nodes goes into new shards (:func:`_publish_new_shards`): the index
    is stored as shards, and its rows keep their degree (it has more than k nodes already)."""
    n_old = manifest["counts"]["nodes"]
    return len(index_shards(manifest)) > 1 and new_nodes > 0 and degree(k, n_old) == degree(k, n_old + new_nodes)


def _new_nodes(
    manifest: dict,
    chunks: list[Chunk],
    config: IndexConfig,
    summary: IndexSummary,
    llm: LLMBackend | None,
    embedder: Embedder | None,
    cluster,
) -> Additions:
    """The pairs of ``chunks`` (generated; cached ones reused), their texts embedded and selected into
    nodes, as the index's models make them. Refused, changing nothing, when a chunk gets no LLM reply."""
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
        how = f"{OVER_CONTEXT_ADVICE}, then rerun" if over_context(summary.failed_chunks) else "rerun to retry"
        raise QCGError(
            f"{counted(len(summary.failed_chunks), 'chunk')} got no LLM reply ({summary.failed_chunks[0][1]}); "
            f"the index is unchanged; {how} (replies made so far are cached)"
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
    summary.pairs_valid, summary.pairs_kept = len(pairs), len(pairs.kept_rows())
    return Additions(chunks, pairs, embedded)


def _with_nodes(stored: _Stored, added: Additions, config: IndexConfig, summary: IndexSummary) -> _Stored:
    """``stored`` with ``added`` appended, its nodes added to the kNN graph."""
    manifest, embedded = stored.manifest, added.embedded
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
    new_tables = added.tables(counts["chunks"], counts["pairs"], counts["nodes"])
    tables = {name: pa.concat_tables([stored.tables[name], new_tables[name]]) for name in stored.tables}
    new_arrays = {
        "chunk_embeddings": embedded.chunk_embeddings,
        "pair_embeddings": embedded.pair_embeddings,
        "node_embeddings": embedded.node_embeddings,
    }
    arrays = {name: np.concatenate([old, new_arrays[name].astype(old.dtype)]) for name, old in stored.arrays.items()}
    summary.nodes, summary.edges = len(embedded.nodes.text), len(graph.indices)
    return _Stored({**manifest, "counts": _dropped_counted(manifest, summary)}, tables, arrays, graph)


def _dropped_counted(manifest: dict, summary: IndexSummary) -> dict:
    """The manifest's counts with the pairs this update dropped added (pairs_dropped: over every generation)."""
    dropped = Counter(manifest["counts"].get("pairs_dropped", {})) + summary.dropped
    return {**manifest["counts"], "pairs_dropped": dict(dropped)}


def _without_documents(
    stored: _Stored, keep_chunk: np.ndarray, doc_ids: list[str], config: IndexConfig, summary: IndexSummary
) -> _Stored:
    """``stored`` without the documents ``doc_ids`` (the chunks ``keep_chunk`` does not mark): the rest
    renumbered in order, the graph rows that lost an out-neighbour searched again."""
    ids = Renumbering.keeping(
        keep_chunk, *(stored.tables[name].column("chunk_id").to_numpy() for name in ("pairs", "nodes"))
    )
    with stage(summary, "knn"):
        graph = remove_nodes(
            stored.graph,
            np.asarray(stored.arrays["node_embeddings"], np.float32),
            ids.nodes >= 0,
            config.graph.knn_k,
            config.graph.knn_backend,
            config.nodes.device,
        )
    pair_nodes = config.nodes.nodes != "sentence"
    tables = {name: ids.table(name, table, 0, pair_nodes) for name, table in stored.tables.items()}
    arrays = {name: stored.arrays[name][getattr(ids, space) >= 0] for name, space in EMBEDDINGS.items()}
    _count_removed(summary, ids, doc_ids)
    return _Stored(_renumbered(stored.manifest, ids), tables, arrays, graph)


def _count_removed(summary: IndexSummary, ids: Renumbering, doc_ids: list[str]) -> None:
    summary.documents, summary.chunks = len(set(doc_ids)), int((ids.chunks < 0).sum())
    summary.pairs_valid, summary.nodes = int((ids.pairs < 0).sum()), int((ids.nodes < 0).sum())  # removed


def _renumbered(manifest: dict, ids: Renumbering) -> dict:
    """The manifest's lists of chunk ids (failed chunks, replies from earlier runs), renumbered like the chunks."""
    failed = [[int(ids.chunks[c]), error] for c, error in manifest.get("failed_chunks", []) if ids.chunks[c] >= 0]
    manifest = {**manifest, "failed_chunks": failed}
    if "replies_from_earlier_runs" in manifest:  # absent from indexes built before it was recorded
        earlier = ids.chunks[range_ids(manifest["replies_from_earlier_runs"])]
        manifest["replies_from_earlier_runs"] = chunk_ranges(earlier[earlier >= 0])
    return manifest


def _publish_kept_shards(
    index: Path,
    manifest: dict,
    ids: Renumbering,
    config: IndexConfig,
    summary: IndexSummary,
    change: dict,
    added: Additions | None = None,
    cluster=None,
) -> None:
    """Publish a sharded index without the chunks ``ids`` removes, one shard at a time (:mod:`shard_removal`),
    and for a retry with ``added`` as new shards after them: nothing loads the whole index. With a Ray
    ``cluster``, a task per shard searches its kNN rows."""
    layout = ids.shards(index_shards(manifest))
    doc_ids = load_table(index, "chunks", manifest, columns=["doc_id"]).filter(pa.array(ids.chunks >= 0))
    counts = _kept_counts(index, manifest, ids)
    tables, arrays = kept_tables(index, manifest, layout, ids), kept_embeddings(index, manifest, layout, ids)
    shards, new_nodes = [new for _, new in layout], None
    if added is None:
        _count_removed(summary, ids, change["documents"])
    else:
        new_tables, counts = _added_rows(added, counts, manifest, summary)
        tables = {name: itertools.chain(parts, [new_tables[name]]) for name, parts in tables.items()}
        arrays = {name: _appended(parts, getattr(added.embedded, name)) for name, parts in arrays.items()}
        doc_ids = pa.concat_tables([doc_ids, new_tables["chunks"].select(["doc_id"])])
        node_chunk = new_tables["nodes"].column("chunk_id").to_numpy()
        shards += plan_added_shards(shards, node_chunk, counts["chunks"], config.graph.shard_nodes)
        new_nodes = np.asarray(added.embedded.node_embeddings, np.float32) if len(node_chunk) else None
        summary.nodes = len(node_chunk)
    counts["knn_edges"] = counts["nodes"] * degree(config.graph.knn_k, counts["nodes"])
    summary.edges = counts["knn_edges"]
    updated = _next_manifest(_renumbered(manifest, ids), counts, doc_ids, summary, change)

    def graph(writer: IndexWriter) -> None:
        with stage(summary, "knn"):
            write_kept_rows(writer, data_dir(index, manifest), manifest, layout, ids, config, new_nodes, cluster)

    write_index(index, tables, arrays, graph, updated, summary, shards)


def _kept_counts(index: Path, manifest: dict, ids: Renumbering) -> dict:
    """The manifest's counts of what stays once ``ids`` removes chunks (knn_edges: set by the caller)."""
    kept_pairs = load_table(index, "pairs", manifest, columns=["kept"]).column("kept").to_numpy(zero_copy_only=False)
    n_pairs = load_table(index, "chunks", manifest, columns=["n_pairs"]).column("n_pairs").to_numpy()
    pair_modes = manifest["settings"]["nodes"]["nodes"] != "sentence"
    return {
        **manifest["counts"],
        "chunks": int((ids.chunks >= 0).sum()),
        "pairs_valid": int((ids.pairs >= 0).sum()),
        "pairs_kept": int(kept_pairs[ids.pairs >= 0].sum()),
        "nodes": int((ids.nodes >= 0).sum()),
        "chunks_without_pairs": int((n_pairs[ids.chunks >= 0] == 0).sum()) if pair_modes else 0,
    }


def _appended(parts: ArrayParts, rows: np.ndarray) -> ArrayParts:
    """An array's kept rows (``parts``) and then ``rows``, in its dtype."""
    shape = (parts.shape[0] + len(rows), *parts.shape[1:])
    return ArrayParts(shape, parts.dtype, itertools.chain(parts.parts, [np.asarray(rows, parts.dtype)]))


def _publish(index: Path, stored: _Stored, summary: IndexSummary, change: dict) -> None:
    """Write the updated index as a new version and publish it; counts are taken from what is written."""
    manifest, tables, graph = stored.manifest, stored.tables, stored.graph
    counts = {**manifest["counts"], **_row_counts(tables, manifest), "knn_edges": len(graph.indices)}
    updated = _next_manifest(manifest, counts, tables["chunks"], summary, change)
    shards = build_shards(updated, tables["nodes"].column("chunk_id").to_numpy())
    write_index(index, tables, stored.arrays, graph, updated, summary, shards)


def _publish_new_shards(
    index: Path,
    manifest: dict,
    doc_ids: pa.Table,
    added: Additions,
    config: IndexConfig,
    summary: IndexSummary,
    change: dict,
    cluster,
) -> None:
    """Publish a sharded index with ``added`` as new shards after its own, which are kept as they are but
    for their kNN rows (:func:`knn.grow_shards`): nothing loads the whole index."""
    tables, counts = _added_rows(added, manifest["counts"], manifest, summary)
    embedded = added.embedded
    counts["knn_edges"] = counts["nodes"] * degree(config.graph.knn_k, counts["nodes"])
    every_doc_id = pa.concat_tables([doc_ids, tables["chunks"].select(["doc_id"])])
    updated = _next_manifest(manifest, counts, every_doc_id, summary, change)
    dtype = config.nodes.embedding_dtype
    arrays = {
        "chunk_embeddings": embedded.chunk_embeddings,
        "pair_embeddings": embedded.pair_embeddings.astype(dtype),
        "node_embeddings": embedded.node_embeddings.astype(dtype),
    }
    summary.nodes, summary.edges = len(embedded.nodes.text), counts["knn_edges"]

    def graph(writer: IndexWriter) -> None:
        with stage(summary, "knn"):
            if cluster is None:
                grow_shards(writer, data_dir(index, manifest), manifest, arrays["node_embeddings"], config)
            else:
                from .distributed import grow_shards_on

                grow_shards_on(cluster, writer, data_dir(index, manifest), manifest, arrays["node_embeddings"], config)

    node_chunk = tables["nodes"].column("chunk_id").to_numpy()
    kept = index_shards(manifest)
    shards = kept + plan_added_shards(kept, node_chunk, counts["chunks"], config.graph.shard_nodes)
    write_index(index, tables, arrays, graph, updated, summary, shards, reuse=manifest)


def _added_rows(added: Additions, counts: dict, manifest: dict, summary: IndexSummary) -> tuple[dict, dict]:
    """``added``'s table rows, numbered after the rows ``counts`` gives, and those counts grown by them
    (and by the pairs this update dropped)."""
    counts = _dropped_counted({"counts": counts}, summary)
    tables = added.tables(counts["chunks"], counts["pairs_valid"], counts["nodes"])
    counts |= {name: counts.get(name, 0) + rows for name, rows in _row_counts(tables, manifest).items()}
    return tables, counts


def _row_counts(tables: dict, manifest: dict) -> dict:
    """The counts of rows in ``tables`` (chunks, pairs, nodes) a manifest gives: tables side by side add up."""
    chunks, pairs = tables["chunks"], tables["pairs"]
    pair_modes = manifest["settings"]["nodes"]["nodes"] != "sentence"
    return {
        "chunks": chunks.num_rows,
        "pairs_valid": pairs.num_rows,
        "pairs_kept": int(np.asarray(pairs.column("kept")).sum()),  # pairs_dropped: over every generation
        "nodes": tables["nodes"].num_rows,
        "chunks_without_pairs": int((np.asarray(chunks.column("n_pairs")) == 0).sum()) if pair_modes else 0,
    }


def _next_manifest(manifest: dict, counts: dict, chunks: pa.Table, summary: IndexSummary, change: dict) -> dict:
    """The manifest of the updated index: ``counts``, and what this update spent and changed (``chunks``:
    every chunk's doc_id)."""
    tokens, now = manifest.get("llm_tokens", {}), time.time()
    counts = {
        **counts,
        "documents": len(set(chunks.column("doc_id").to_pylist())),
        "chunks_failed": len(manifest.get("failed_chunks", [])),
    }
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
    return updated
