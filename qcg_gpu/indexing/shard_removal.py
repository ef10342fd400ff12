"""Remove documents from an index stored in node shards, one shard at a time.

:func:`incremental.remove_documents` loads an index stored whole. A sharded index may be larger than
one machine, so here each shard is read, filtered and renumbered on its own: the removed documents'
chunks, pairs and nodes go, every id after them moves down (:class:`Renumbering`), a shard left with no
chunk goes, and each kNN row keeps its edges, renumbered, or, where it lost one, is searched again over
every shard of the new version (:func:`ranking.best_over_shards`). The result equals
:func:`knn.remove_nodes`' and so a rebuild's, but for where the shards are cut (a rebuild cuts them
again). In memory: one shard, and an id map of 8 bytes per chunk, pair and node.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..index_format import ArrayParts, IndexWriter, Shard, index_shards, load_shard_array, load_shard_table
from .knn import merge_new_nodes, shard_rows
from .ranking import best_in, best_over_shards, csr_of_rows, degree, read_node_embeddings

EMBEDDINGS = {"chunk_embeddings": "chunks", "pair_embeddings": "pairs", "node_embeddings": "nodes"}


@dataclass
class Renumbering:
    """Each chunk's, pair's and node's new id once some chunks are removed (-1: removed), in order."""

    chunks: np.ndarray
    pairs: np.ndarray
    nodes: np.ndarray

    @classmethod
    def keeping(cls, keep_chunk: np.ndarray, pair_chunk: np.ndarray, node_chunk: np.ndarray) -> Renumbering:
        """Keep the chunks ``keep_chunk`` marks, with their pairs and nodes (``*_chunk``: each one's chunk)."""
        keeps = (keep_chunk, keep_chunk[pair_chunk], keep_chunk[node_chunk])
        return cls(*(np.where(keep, np.cumsum(keep) - 1, -1) for keep in keeps))

    def shards(self, old: list[Shard]) -> list[tuple[Shard, Shard]]:
        """Each old shard that keeps a chunk, and what it becomes: the new ids of what it keeps (ranges
        again, ids being in order), named in order."""
        before = {space: np.r_[0, np.cumsum(getattr(self, space) >= 0)] for space in ("chunks", "pairs", "nodes")}
        kept: list[tuple[Shard, Shard]] = []
        for shard in old:
            new = {space: (int(b[shard.rows(space)[0]]), int(b[shard.rows(space)[1]])) for space, b in before.items()}
            if new["chunks"][1] > new["chunks"][0]:
                kept.append((shard, Shard(f"{len(kept):05d}", new["nodes"], new["chunks"], new["pairs"])))
        return kept

    def table(self, name: str, table: pa.Table, first_pair: int, pair_nodes: bool) -> pa.Table:
        """The rows of table ``name`` (chunks, pairs or nodes; pairs from id ``first_pair``) that stay, renumbered."""
        if name == "pairs":
            new = self.pairs[first_pair + np.arange(table.num_rows)]
        else:
            new = getattr(self, name)[table.column(f"{name[:-1]}_id").to_numpy()]
        table = table.filter(pa.array(new >= 0))
        chunk_ids = pa.array(self.chunks[table.column("chunk_id").to_numpy()])
        table = table.set_column(table.schema.get_field_index("chunk_id"), "chunk_id", chunk_ids)
        if name == "nodes":
            table = table.set_column(0, "node_id", pa.array(new[new >= 0]))
            if pair_nodes:  # pair nodes name pairs.parquet rows, which moved
                sources = self.pairs[table.column("source_index").to_numpy()]
                table = table.set_column(2, "source_index", pa.array(sources))
        return table


def kept_tables(index: Path, manifest: dict, layout: list[tuple[Shard, Shard]], ids: Renumbering) -> dict:
    """Each table's rows that stay, renumbered, as the parts of the new shards in order (one shard read at a time)."""
    pair_nodes = manifest["settings"]["nodes"]["nodes"] != "sentence"

    def parts(name: str):
        for old, _ in layout:
            yield ids.table(name, load_shard_table(index, manifest, old, name), old.pairs[0], pair_nodes)

    return {name: parts(name) for name in ("nodes", "chunks", "pairs")}


def kept_embeddings(index: Path, manifest: dict, layout: list[tuple[Shard, Shard]], ids: Renumbering) -> dict:
    """Each embedding array's rows that stay, as the parts of the new shards in order."""

    def parts(name: str, space: str):
        for old, _ in layout:
            rows = load_shard_array(index, manifest, old, name)
            yield np.asarray(rows[getattr(ids, space)[slice(*old.rows(space))] >= 0])

    arrays = {}
    for name, space in EMBEDDINGS.items():
        first = load_shard_array(index, manifest, layout[0][0], name)
        rows = int((getattr(ids, space) >= 0).sum())
        arrays[name] = ArrayParts((rows, *first.shape[1:]), first.dtype, parts(name, space))
    return arrays


@dataclass(frozen=True)
class Versions:
    """The index's files before a removal (its data folder and shard list) and after (the new version's)."""

    old_data: str
    old_layout: dict
    new_data: str
    new_layout: dict


def kept_rows(versions: Versions, old: Shard, shard: int, nodes: np.ndarray, config, new=None):
    """New shard ``shard``'s kNN rows from old shard ``old``'s (``nodes``: each old node's new id): the
    edges of a row that stays, renumbered, and a row that lost one searched again over every new shard
    (with ``config``'s kNN backend and device). ``new``: the embeddings of the nodes a retry adds after
    the kept ones, which the other rows are grown against (:func:`knn.merge_new_nodes`). One task of a
    removal on Ray: it reads this shard and, one at a time, the others."""
    lo, hi = old.nodes
    keep = nodes[lo:hi] >= 0
    if not keep.any():
        return csr_of_rows(np.zeros((0, 0), np.int64), np.zeros((0, 0)))
    edges, scores = (
        np.array(load_shard_array(versions.old_data, versions.old_layout, old, name, verify=False)).reshape(
            hi - lo, -1
        )[keep]
        for name in ("knn_indices", "knn_scores")
    )
    edges, k = nodes[edges], edges.shape[1]
    lost = (edges < 0).any(axis=1)
    if new is None and not lost.any():  # no row lost an edge: renumbered, the shard's embeddings never read
        return csr_of_rows(edges, scores)
    data, layout = versions.new_data, versions.new_layout
    own, backend, device = index_shards(layout)[shard], config.graph.knn_backend, config.nodes.device
    rows = read_node_embeddings(data, layout, own)
    if lost.any():
        found = best_over_shards(data, layout, rows[lost], own.nodes[0] + np.flatnonzero(lost), k, backend, device)
        edges[lost], scores[lost] = found
    if new is not None and (~lost).any():
        first_new = int((nodes >= 0).sum())
        best_new = best_in(rows[~lost], None, new, np.arange(first_new, first_new + len(new)), k, backend, device)
        grown = (edges[~lost], scores[~lost])
        merge_new_nodes(data, layout, rows[~lost], grown, best_new)
        edges[~lost], scores[~lost] = grown
    return csr_of_rows(edges, scores)


def write_kept_rows(
    writer: IndexWriter, data: Path, manifest: dict, layout, ids: Renumbering, config, new=None, cluster=None
):
    """Every new shard's kNN rows: the kept shards' (:func:`kept_rows`), then those of the shards a retry
    adds after them (``new``: their nodes' embeddings), searched over every shard; one shard at a time
    here, or a Ray task per shard on ``cluster`` (:func:`kept_rows_on`)."""
    versions = Versions(str(data), {"shards": manifest["shards"]}, str(writer.data), writer_layout(writer))
    if cluster is not None:
        kept_rows_on(cluster, writer, versions, [old for old, _ in layout], ids.nodes, config, new)
        return
    for shard, (old, _) in enumerate(layout):
        writer.write_shard_graph(shard, *kept_rows(versions, old, shard, ids.nodes, config, new))
    backend, device, k = config.graph.knn_backend, config.nodes.device, config.graph.knn_k
    for shard in range(len(layout), len(writer.shards or [])):
        writer.write_shard_graph(shard, *shard_rows(versions.new_data, versions.new_layout, shard, k, backend, device))


def kept_rows_on(cluster, writer: IndexWriter, versions: Versions, kept: list[Shard], nodes, config, new) -> None:
    """:func:`write_kept_rows` with a Ray task per shard: each kept shard's rows (``kept``: the old shard
    each new one keeps; ``nodes``: each old node's new id, put in the object store once, as ``new`` is),
    then each shard a retry adds, searched over the new version's files; written as they come back."""
    from .distributed import write_as_done

    cluster.release()
    ray, backend, device, k = cluster.ray, config.graph.knn_backend, config.nodes.device, config.graph.knn_k
    keep, search = (cluster.task(f) for f in (kept_rows, shard_rows))
    ids, added = ray.put(nodes), ray.put(new)
    pending = {keep.remote(versions, old, i, ids, config, added): i for i, old in enumerate(kept)}
    for i in range(len(kept), len(writer.shards or [])):
        pending[search.remote(versions.new_data, versions.new_layout, i, k, backend, device)] = i
    write_as_done(cluster, writer, pending)


def writer_layout(writer: IndexWriter) -> dict:
    """The shards of the version ``writer`` writes, as a manifest lists them."""
    return {"shards": [s.to_dict() for s in writer.shards or []]}


def keeps_degree(ids: Renumbering, k: int) -> bool:
    """Whether the rows keep their degree (the index keeps more than k nodes): else the graph is rebuilt."""
    return degree(k, int((ids.nodes >= 0).sum())) == degree(k, len(ids.nodes))
