"""The index build on a Ray cluster, shard by shard, so that the driver never holds the corpus.

One process holds every chunk's text, pairs and embeddings at once: about 40 KB a chunk at
M = 20, 4 GB per 100k chunks. The driver of a Ray build streams the corpus through in shards of
``--ray-shard-chunks`` chunks instead, and keeps per chunk only its bookkeeping (its reply key):

1. chunk and generate: documents are read and cut as they stream in; each shard's chunks without
   a reply go to the engines on the workers (:class:`distributed.RayLLM`, loaded once for all
   shards), each reply is cached as it arrives, and the shard's chunks and parsed pairs are staged.
2. embed: each staged shard goes to an embedder actor, which embeds its chunks and pairs, selects
   the pairs (Doc2Query--) and makes the nodes (:func:`stages.embed_and_select`); what comes back
   is staged and dropped. Fewer shards than workers are cut into one per worker first
   (:meth:`Staging.spread`).
3. kNN: the nodes' embeddings, left in the object store by the embedder actors, are joined there
   (:func:`distributed.knn_graph_of_parts`); row blocks are searched by tasks. An index stored as
   node shards (``--shard-nodes``) gets its graph once its embeddings are written instead: a task
   per shard ranks its rows against every shard's file in turn (:func:`distributed.knn_of_shards`).
4. write: each index file is streamed from the staged shards in order, renumbered.

The staging directory sits next to the output, on the driver's disk (workers send their results
back through the object store, so no shared filesystem is needed), and is removed at the end,
whatever happens. The index equals the one-process build's byte for byte: the same replies (the
generation cache), the same bits per embedding (:mod:`embedding`), Parquet row groups of a fixed
size (:mod:`index_format`).
"""

from __future__ import annotations

import itertools
import shutil
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..cluster import RayCluster
from ..config import IndexConfig, NodeConfig
from ..index_format import TABLES, ArrayParts, IndexWriter, plan_shards
from ..log import progress_bar
from .chunking import Chunk
from .distributed import EmbedWorker, knn_graph_of_parts, knn_of_shards, ray_llm
from .documents import SkipLog
from .generation import Doc2QueryRun
from .ranking import degree
from .stages import (
    IndexSummary,
    Pairs,
    build_manifest,
    build_shards,
    embed_and_select,
    index_tables,
    iter_chunks,
    no_chunks_error,
    stage,
    write_index,
)


def build_on_cluster(
    input_path, out: Path, config: IndexConfig, cluster: RayCluster, llm=None, summary: IndexSummary | None = None
) -> IndexSummary:
    """:func:`pipeline.build_index` on ``cluster``, shard by shard (see the module's docstring)."""
    summary = summary or IndexSummary(out=out)
    staging = Staging(out.with_name(f".{out.name}.shards-{uuid.uuid4().hex[:12]}"))
    try:
        model_name = None
        if config.nodes.nodes != "sentence":
            llm = llm or ray_llm(cluster, config.generation)
            model_name = llm.model_name
        doc2query = Doc2QueryRun(llm, model_name, config, summary) if model_name else None
        try:
            _chunk_and_generate(input_path, config, doc2query, summary, staging, cluster.config.ray_shard_chunks)
        finally:
            if doc2query:
                doc2query.close()
        embedder, node_embeddings = _embed(staging, config.nodes, cluster, summary)
        node_chunk = staging.node_chunk()
        n_chunks = sum(count["chunks"] for count in staging.counts)
        graph = _graph(cluster, config, summary, node_embeddings, node_chunk, n_chunks)
        manifest = build_manifest(config, summary, model_name, embedder)
        tables = staging.index_tables(from_pairs=model_name is not None)
        arrays = staging.index_arrays(config.nodes)
        write_index(out, tables, arrays, graph, manifest, summary, build_shards(manifest, node_chunk))
    finally:
        staging.remove()
    for leftover in out.parent.glob(f".{out.name}.shards-*"):  # of builds killed before they ended
        shutil.rmtree(leftover, ignore_errors=True)
    return summary


def _graph(
    cluster: RayCluster, config: IndexConfig, summary: IndexSummary, node_embeddings: list, node_chunk, n_chunks: int
):
    """The kNN graph from the embeddings in the object store; for an index stored as node shards, what
    ranks it from the shards' files once they are written (a task per shard, two shards held at most)."""
    settings = config.graph
    if len(plan_shards(node_chunk, n_chunks, settings.shard_nodes)) > 1:
        summary.edges = summary.nodes * degree(settings.knn_k, summary.nodes)

        def from_shards(writer: IndexWriter) -> None:
            with stage(summary, "knn"):
                knn_of_shards(
                    cluster, writer, settings.knn_k, settings.knn_backend, config.nodes.device, settings.probes()
                )

        return from_shards
    with stage(summary, "knn"):
        graph = knn_graph_of_parts(
            cluster,
            node_embeddings,
            summary.nodes,
            settings.knn_k,
            settings.knn_backend,
            config.nodes.device,
            settings.probes(),
        )
    summary.edges = len(graph.indices)
    return graph


def _chunk_and_generate(
    input_path,
    config: IndexConfig,
    doc2query: Doc2QueryRun | None,
    summary: IndexSummary,
    staging: Staging,
    shard_chunks: int,
) -> None:
    """Stage the corpus's chunks and their parsed pairs (none for sentence nodes: ``doc2query`` None),
    ``shard_chunks`` chunks a shard."""
    skips = SkipLog()
    chunks = _timed(iter_chunks(input_path, config, summary, skips), summary, "chunk")
    while shard := list(itertools.islice(chunks, shard_chunks)):
        pairs = doc2query.pairs(shard, first_chunk=summary.chunks) if doc2query else Pairs.empty()
        staging.put_input(shard, pairs)
        summary.chunks += len(shard)
        summary.pairs_valid += len(pairs)
    summary.skipped = skips.items
    if not summary.chunks:
        raise no_chunks_error(input_path, skips)


def _timed(items: Iterator, summary: IndexSummary, name: str) -> Iterator:
    """``items`` with the time spent making them added to ``summary``'s stage ``name``."""
    while True:
        with stage(summary, name, quiet=True):
            item = next(items, None)
        if item is None:
            return
        yield item


class _ShardWorker(EmbedWorker):
    """An embedder per actor, kept for the whole build; each call does one shard's embed stage."""

    def __init__(self, nodes: NodeConfig):
        super().__init__(nodes.embedder, nodes.device, nodes.embed_batch_size, nodes.long_texts)
        self.nodes = nodes

    def embed_shard(self, shard: int, chunks: list[Chunk], pairs: Pairs) -> tuple[dict, np.ndarray]:
        """The shard's index tables (numbered from 0 within it), embeddings and counts, and apart
        (a second return value, left in the object store for the kNN tasks) its node embeddings."""
        windowed = self.embedder.windowed_texts
        embedded = embed_and_select(chunks, pairs, self.nodes, self.embedder)
        return {
            "shard": shard,
            "tables": index_tables(chunks, pairs, embedded.nodes),
            "arrays": {
                "chunk_embeddings": embedded.chunk_embeddings,
                "pair_embeddings": embedded.pair_embeddings,
                "node_embeddings": embedded.node_embeddings,
            },
            "pairs_kept": len(pairs.kept_rows()),
            "windowed": self.embedder.windowed_texts - windowed,
        }, embedded.node_embeddings


@dataclass
class EmbedderInfo:
    """What the manifest records of the workers' embedder."""

    model_name: str
    dim: int
    max_tokens: int
    batch_size: int


def _embed(
    staging: Staging, nodes: NodeConfig, cluster: RayCluster, summary: IndexSummary
) -> tuple[EmbedderInfo, list]:
    """Each staged shard through an embedder actor, one shard in flight per worker; results staged.
    Returns the embedder's description and object refs of the shards' node embeddings: made by the
    workers and left in the object store, so that this process never holds them all."""
    ray = cluster.ray
    staging.spread(cluster.workers)
    with stage(summary, "load_embedder"):
        workers = cluster.actors(_ShardWorker, nodes)
        model_name, dim, max_tokens = ray.get(workers[0].describe.remote())
    node_embeddings: list = [None] * len(staging.counts)
    todo, running = iter(staging.shards()), {}  # result ref -> its worker

    def send_next(worker) -> None:
        if (shard := next(todo, None)) is not None:
            call = worker.embed_shard.options(num_returns=2)
            result, node_embeddings[shard] = call.remote(shard, *staging.input(shard))
            running[result] = worker

    with stage(summary, "embed"), progress_bar(total=len(staging.counts), desc="embed shards", unit="shard") as bar:
        for worker in workers:
            send_next(worker)
        while running:
            [done], _ = ray.wait(list(running), num_returns=1)
            send_next(running.pop(done))  # the worker goes on while this shard's result is staged
            result = ray.get(done)
            staging.put_output(result["shard"], result["tables"], result["arrays"])
            summary.pairs_kept += result["pairs_kept"]
            summary.texts_over_windows += result["windowed"]
            bar.update(1)
    cluster.release()
    summary.nodes = sum(count["nodes"] for count in staging.counts)
    return EmbedderInfo(model_name, dim, max_tokens, nodes.embed_batch_size), node_embeddings


class Staging:
    """The shards between the stages, on disk: each one's input (chunks and pairs) and output
    (index tables numbered within the shard, embeddings); rows counted per shard."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True)
        self.counts: list[dict] = []  # per shard: chunks, pairs, nodes

    def shards(self) -> range:
        return range(len(self.counts))

    def put_input(self, chunks: list[Chunk], pairs: Pairs) -> None:
        self.counts.append({})
        self._put_input(len(self.counts) - 1, chunks, pairs)

    def _put_input(self, shard: int, chunks: list[Chunk], pairs: Pairs) -> None:
        self._write(shard, "input_chunks", pa.Table.from_pylist([vars(c) for c in chunks]))
        self._write(shard, "input_pairs", _pairs_table(pairs))
        self.counts[shard] = {"chunks": len(chunks), "pairs": len(pairs), "nodes": 0}

    def spread(self, parts: int) -> None:
        """Cut the staged shards at chunk boundaries into ``parts`` or more, where there are fewer: a
        worker embeds one shard at a time, so a corpus of one shard left every other worker idle. The
        shards go from the last, so none is overwritten before it is read. An embedding does not depend
        on its batch, nor a pair's selection on other chunks: the index is the same."""
        each = -(-parts // max(len(self.counts), 1))
        if each <= 1:
            return
        pieces = [min(each, count["chunks"]) for count in self.counts]
        first = np.cumsum([0] + pieces)
        self.counts += [{}] * (int(first[-1]) - len(self.counts))
        for shard in reversed(range(len(pieces))):
            chunks, pairs = self.input(shard)
            for i, rows in enumerate(np.array_split(np.arange(len(chunks)), pieces[shard])):
                start, stop = int(rows[0]), int(rows[-1]) + 1
                self._put_input(int(first[shard]) + i, chunks[start:stop], pairs.of_chunks(start, stop))

    def input(self, shard: int) -> tuple[list[Chunk], Pairs]:
        chunks = [Chunk(**row) for row in self._read(shard, "input_chunks").to_pylist()]
        pairs = self._read(shard, "input_pairs")
        return chunks, Pairs(
            pairs.column("chunk_id").to_numpy().astype(np.int64),
            pairs.column("gen_index").to_numpy().astype(np.int64),
            pairs.column("question").to_pylist(),
            pairs.column("answer").to_pylist(),
        )

    def put_output(self, shard: int, tables: dict, arrays: dict) -> None:
        for name, table in tables.items():
            self._write(shard, name, table)
        for name, array in arrays.items():
            np.save(self.root / f"{shard}-{name}.npy", array, allow_pickle=False)
        self.counts[shard]["nodes"] = tables["nodes"].num_rows

    def array(self, shard: int, name: str) -> np.ndarray:
        return np.load(self.root / f"{shard}-{name}.npy", allow_pickle=False)

    def index_tables(self, from_pairs: bool) -> dict[str, Iterable[pa.Table]]:
        """Each index table as its shards' parts in order, numbered across the shards (``from_pairs``:
        the nodes' source_index names pairs rows, else sentence numbers within a chunk)."""
        return {name: self._table_parts(name, from_pairs) for name in TABLES}

    def index_arrays(self, nodes: NodeConfig) -> dict[str, ArrayParts]:
        """The embeddings as their shards' parts in order, in the types the index stores."""
        dtypes = {
            "chunk_embeddings": np.dtype(np.float32),
            "pair_embeddings": np.dtype(nodes.embedding_dtype),
            "node_embeddings": np.dtype(nodes.embedding_dtype),
        }
        rows = {"chunk_embeddings": "chunks", "pair_embeddings": "pairs", "node_embeddings": "nodes"}
        dim = self.array(0, "chunk_embeddings").shape[1]
        return {
            name: ArrayParts(
                (sum(count[rows[name]] for count in self.counts), dim),
                dtype,
                self._array_parts(name),
            )
            for name, dtype in dtypes.items()
        }

    def node_chunk(self) -> np.ndarray:
        """Each node's chunk id, numbered across the shards (one column: what cutting node shards needs)."""
        first = np.cumsum([0] + [count["chunks"] for count in self.counts])
        return (
            np.concatenate(
                [
                    pq.read_table(self.root / f"{s}-nodes.parquet", columns=["chunk_id"]).column("chunk_id").to_numpy()
                    + first[s]
                    for s in self.shards()
                ]
            )
            if len(self.counts)
            else np.zeros(0, np.int64)
        )

    def _table_parts(self, name: str, from_pairs: bool) -> Iterator[pa.Table]:
        for shard in self.shards():
            yield self._renumbered(shard, name, from_pairs)

    def _array_parts(self, name: str) -> Iterator[np.ndarray]:
        for shard in self.shards():
            yield self.array(shard, name)

    def _renumbered(self, shard: int, name: str, from_pairs: bool) -> pa.Table:
        """A shard's table with its ids moved past the earlier shards' rows."""
        first = {key: sum(count[key] for count in self.counts[:shard]) for key in ("chunks", "pairs", "nodes")}
        table = self._read(shard, name)
        offsets = {"chunk_id": first["chunks"]}
        if name == "nodes":
            offsets["node_id"] = first["nodes"]
            if from_pairs:
                offsets["source_index"] = first["pairs"]
        for column, offset in offsets.items():
            position = table.schema.get_field_index(column)
            table = table.set_column(position, column, pc.add(table.column(column), offset))
        return table

    def _write(self, shard: int, name: str, table: pa.Table) -> None:
        pq.write_table(table, self.root / f"{shard}-{name}.parquet")

    def _read(self, shard: int, name: str) -> pa.Table:
        return pq.read_table(self.root / f"{shard}-{name}.parquet")

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _pairs_table(pairs: Pairs) -> pa.Table:
    return pa.table(
        {
            "chunk_id": pa.array(pairs.chunk_id, pa.int64()),
            "gen_index": pa.array(pairs.gen_index, pa.int64()),
            "question": pa.array(pairs.question, pa.string()),
            "answer": pa.array(pairs.answer, pa.string()),
        }
    )
