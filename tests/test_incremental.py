"""Adding and removing documents (qcg index --add / --remove) equals a full rebuild, on real models."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from qcg_gpu import build_index
from qcg_gpu.embedding import Embedder
from qcg_gpu.errors import QCGError
from qcg_gpu.index_format import index_shards, load_array, load_table, read_manifest
from qcg_gpu.indexing.incremental import _Stored, add_documents, remove_documents, retry_failed

from .conftest import SAMPLE_DOCS, sample_docs
from .test_index_build import Recording, _config

ARRAYS = ("chunk_embeddings", "pair_embeddings", "node_embeddings", "knn_indptr", "knn_indices", "knn_scores")


def _split_docs(tmp_path, n_old: int, n_new: int):
    """Old and new documents in two directories, and all of them in a third (new ones sort last)."""
    every = sample_docs(tmp_path / "all", n_old + n_new)
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir(), new.mkdir()
    for i, path in enumerate(sorted(every.glob("*.txt"))):
        shutil.copy(path, (old if i < n_old else new) / path.name)
    return old, new, every


def _docs_but(every, removed: list[str], folder):
    """A folder of ``every``'s documents but the ``removed`` ones (what a rebuild after removing reads)."""
    folder.mkdir()
    for path in every.glob("*.txt"):
        if path.stem not in removed:
            shutil.copy(path, folder / path.name)
    return folder


def assert_same_index(got, want):
    for name in ("chunks", "pairs", "nodes"):
        a, b = load_table(got, name), load_table(want, name)
        assert a.column_names == b.column_names and a.num_rows == b.num_rows, name
        for column in a.column_names:
            x, y = a.column(column).to_pylist(), b.column(column).to_pylist()
            if column == "score":
                np.testing.assert_allclose(x, y, atol=1e-5)
            else:
                assert x == y, f"{name}.{column}"
    for name in ARRAYS:
        a, b = load_array(got, name), load_array(want, name)
        if a.dtype.kind == "f":
            np.testing.assert_allclose(a, b, atol=1e-5, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)
    m_got, m_want = read_manifest(got)["counts"], read_manifest(want)["counts"]
    for key in ("documents", "chunks", "pairs_valid", "pairs_kept", "nodes", "knn_edges", "chunks_without_pairs"):
        assert m_got[key] == m_want[key], key


def test_sentence_nodes_add_and_remove_equal_rebuilds(tmp_path, embedder):
    old, new, every = _split_docs(tmp_path, 3, 3)
    config = _config(tmp_path, nodes="sentence")
    build_index(old, tmp_path / "grown", config, embedder=embedder)
    add_documents(tmp_path / "grown", new, config, embedder=embedder)
    build_index(every, tmp_path / "full", config, embedder=embedder)
    assert_same_index(tmp_path / "grown", tmp_path / "full")

    removed = sorted(p.stem for p in new.glob("*.txt"))[:1] + sorted(p.stem for p in old.glob("*.txt"))[:1]
    remove_documents(tmp_path / "grown", removed)
    build_index(_docs_but(every, removed, tmp_path / "rest"), tmp_path / "rest_index", config, embedder=embedder)
    assert_same_index(tmp_path / "grown", tmp_path / "rest_index")
    history = read_manifest(tmp_path / "grown")["history"]
    assert [h["op"] for h in history] == ["add", "remove"]
    total = read_manifest(tmp_path / "full")["counts"]["chunks"]
    assert history[0]["chunk_ids"] == [total - history[0]["chunks"], total]  # the chunks the add made together


@pytest.mark.llm
def test_pair_nodes_add_generates_only_new_chunks_and_equals_a_rebuild(tmp_path, vllm_backend, embedder, monkeypatch):
    old, new, every = _split_docs(tmp_path, 3, 2)
    config = _config(tmp_path)
    build_index(old, tmp_path / "grown", config, llm=vllm_backend, embedder=embedder)
    llm = Recording(vllm_backend)
    summary = add_documents(tmp_path / "grown", new, config, llm=llm, embedder=embedder)
    assert llm.asked == [summary.chunks] and summary.generated_chunks == summary.chunks > 0
    added = read_manifest(tmp_path / "grown")["history"][-1]
    assert "given by the caller (Recording)" in added["llm_reproducibility"]  # what generated the add's replies
    assert (
        added["replies_from_earlier_runs"] == []
        and read_manifest(tmp_path / "grown")["replies_from_earlier_runs"] == []
    )
    build_index(every, tmp_path / "full", config, llm=vllm_backend, embedder=embedder)  # from the cache
    assert_same_index(tmp_path / "grown", tmp_path / "full")
    chunks = read_manifest(tmp_path / "full")["counts"]["chunks"]
    assert read_manifest(tmp_path / "full")["replies_from_earlier_runs"] == [[0, chunks]]  # every reply was cached

    doomed = sorted(p.stem for p in old.glob("*.txt"))[1]
    remove_documents(tmp_path / "full", [doomed])
    pairs, nodes = load_table(tmp_path / "full", "pairs"), load_table(tmp_path / "full", "nodes")
    kept_rows = np.flatnonzero(pairs.column("kept").to_numpy(zero_copy_only=False))
    assert nodes.column("source_index").to_pylist() == kept_rows.tolist()  # nodes still name their pairs rows
    assert doomed not in load_table(tmp_path / "full", "chunks").column("doc_id").to_pylist()
    left = load_table(tmp_path / "full", "chunks").num_rows
    assert left < chunks and read_manifest(tmp_path / "full")["replies_from_earlier_runs"] == [[0, left]]  # renumbered

    # the same in node shards (replies from the cache): the add makes new shards and the remove rewrites
    # each, neither loading the index whole; k = 1 so that the few nodes keep their degree
    config.graph.shard_nodes, config.graph.knn_k = 1, 1
    build_index(old, tmp_path / "sharded", config, llm=vllm_backend, embedder=embedder)
    monkeypatch.setattr(_Stored, "load", lambda index: pytest.fail("a sharded update loaded the index whole"))
    add_documents(tmp_path / "sharded", new, config, llm=vllm_backend, embedder=embedder)
    build_index(every, tmp_path / "sharded_full", config, llm=vllm_backend, embedder=embedder)
    assert_same_index(tmp_path / "sharded", tmp_path / "sharded_full")
    remove_documents(tmp_path / "sharded", [doomed])
    assert len(index_shards(read_manifest(tmp_path / "sharded"))) > 2
    rest = _docs_but(every, [doomed], tmp_path / "rest")
    build_index(rest, tmp_path / "sharded_rest", config, llm=vllm_backend, embedder=embedder)
    assert_same_index(tmp_path / "sharded", tmp_path / "sharded_rest")


@pytest.mark.llm
def test_failed_generation_leaves_the_index_unchanged(tmp_path, vllm_backend, embedder):
    from qcg_gpu.llm.backends import Completion

    old, new, _ = _split_docs(tmp_path, 2, 2)
    config = _config(tmp_path)
    build_index(old, tmp_path / "idx", config, llm=vllm_backend, embedder=embedder)
    before = read_manifest(tmp_path / "idx")
    broken = Recording(
        vllm_backend, fault=lambda i, c: Completion("", 0, 0, "error", error="HTTP 500") if i == 0 else c
    )
    with pytest.raises(QCGError, match="no LLM reply.*unchanged"):
        add_documents(tmp_path / "idx", new, config, llm=broken, embedder=embedder)
    assert read_manifest(tmp_path / "idx") == before
    llm = Recording(vllm_backend)
    add_documents(tmp_path / "idx", new, config, llm=llm, embedder=embedder)
    assert llm.asked == [1]  # only the chunk that failed; the other reply was cached


def test_bad_updates_are_refused(tmp_path, embedder):
    old, new, _ = _split_docs(tmp_path, 2, 1)
    config = _config(tmp_path, nodes="sentence")
    build_index(old, tmp_path / "idx", config, embedder=embedder)
    before = read_manifest(tmp_path / "idx")
    with pytest.raises(QCGError, match="of this input already"):
        add_documents(tmp_path / "idx", old, config, embedder=embedder)
    with pytest.raises(QCGError, match="not in the index"):
        remove_documents(tmp_path / "idx", ["no-such-doc"])
    for ids in ([], "doc"):  # nothing (which wrote a new version), or a string (removed letter by letter)
        with pytest.raises(QCGError, match="give the ids of the documents to remove as a list"):
            remove_documents(tmp_path / "idx", ids)
    with pytest.raises(QCGError, match="empty index"):
        remove_documents(tmp_path / "idx", [p.stem for p in old.glob("*.txt")])
    other = _config(tmp_path, nodes="sentence")
    other.graph.knn_k = 4
    with pytest.raises(QCGError, match="knn_k=4 .*index has 2"):
        add_documents(tmp_path / "idx", new, other, embedder=embedder)
    other = _config(tmp_path, nodes="sentence", embed_batch_size=embedder.batch_size + 1)
    with pytest.raises(QCGError, match="embed_batch_size"):  # it decides an embedding's last bits
        add_documents(tmp_path / "idx", new, other, embedder=embedder)
    with pytest.raises(QCGError, match=f"in batches of {embedder.batch_size} texts; this embedder uses 7"):
        add_documents(tmp_path / "idx", new, config, embedder=Embedder(device="cpu", batch_size=7))
    assert read_manifest(tmp_path / "idx") == before


def test_updates_of_a_path_that_holds_no_index_are_refused_and_leave_nothing_there(tmp_path):
    (tmp_path / "folder").mkdir()
    for index in (tmp_path / "folder", tmp_path / "missing"):  # the missing one was a FileNotFoundError
        for update in (add_documents, retry_failed):
            with pytest.raises(QCGError, match=f"{index} is not a qcg index"):
                update(index, tmp_path) if update is add_documents else update(index)
        with pytest.raises(QCGError, match=f"{index} is not a qcg index"):
            remove_documents(index, ["doc"])
    assert list((tmp_path / "folder").iterdir()) == []  # no lock file left in a folder that is no index


def test_command_line_add_and_remove(tmp_path, cli):
    old, new, _ = _split_docs(tmp_path, 2, 1)
    options = ["--nodes", "sentence", "--device", "cpu", "--quiet"]
    assert cli("index", old, tmp_path / "idx", *options).returncode == 0
    nodes_before = read_manifest(tmp_path / "idx")["counts"]["nodes"]
    added = cli("index", "--add", new, tmp_path / "idx", *options)
    assert added.returncode == 0, added.stderr
    counts = read_manifest(tmp_path / "idx")["counts"]
    assert counts["documents"] == 3
    # the summary counts what was added, but the edges of the whole index (old rows change too)
    graph = f"graph: {counts['nodes'] - nodes_before} nodes added, {counts['knn_edges']} kNN edges in the index"
    assert added.stdout.startswith(f"documents added to {tmp_path / 'idx'}\n") and graph in added.stdout, added.stdout
    planned = cli("index", "plan", new, tmp_path / "idx", "--add")  # the plan refuses what the add would
    assert planned.returncode == 2 and "the index holds 1 document of this input already" in planned.stderr, planned
    doc = next(new.glob("*.txt")).stem
    removed = cli("index", tmp_path / "idx", "--remove", doc, "--quiet")
    assert removed.returncode == 0 and "removed 1 document (" in removed.stdout, removed.stderr
    assert read_manifest(tmp_path / "idx")["counts"]["documents"] == 2
    again = cli("index", tmp_path / "idx", "--remove", doc)
    assert again.returncode == 2 and "not in the index" in again.stderr


@pytest.mark.llm
def test_dry_run_forecast_counts_what_the_build_spends(tmp_path, vllm_backend, embedder):
    from qcg_gpu.indexing.forecast import forecast
    from qcg_gpu.indexing.throughput import measured_runs

    docs = sample_docs(tmp_path / "docs", 3)
    config = _config(tmp_path)
    before = forecast(docs, config)
    assert before.cached_chunks == 0 and "reference" in before.rate_source and before.seconds > 0
    summary = build_index(docs, tmp_path / "idx", config, llm=vllm_backend, embedder=embedder)
    assert before.chunks == summary.chunks and before.documents == summary.documents
    assert before.prompt_tokens == summary.prompt_tokens  # the model's own chat template, counted like vLLM does
    assert before.output_cap >= summary.output_tokens
    written = sum(f.stat().st_size for f in (tmp_path / "idx").rglob("*") if f.is_file())
    assert 0.3 * written <= before.index_bytes <= 3 * written, (before.index_bytes, written)  # an estimate
    runs = measured_runs(config.generation, vllm_backend.model_name)
    assert len(runs) == 1 and runs[0]["output_tokens"] == summary.output_tokens and runs[0]["tokens_per_s"] > 0

    after = forecast(docs, config)
    assert after.cached_chunks == after.chunks and after.output_tokens == 0 and after.prompt_tokens == 0
    more = forecast(sample_docs(tmp_path / "more", 5), config)
    assert more.chunks - more.cached_chunks == 2 and "measured on this machine" in more.rate_source
    assert more.output_tokens == round(summary.output_tokens / summary.chunks * 2)  # the cached replies' mean


def test_a_forecast_from_a_smaller_run_says_its_rate_is_likely_too_slow(tmp_path):
    """A run of 1 chunk (one request in flight) measured 12.6 tok/s, and the plan of 300 short chunks said
    3.2 h as if they would run one at a time. The forecast names the run's size and says so; a run with at
    least as many chunks as the build keeps in flight is taken as it is."""
    from qcg_gpu.indexing.forecast import forecast
    from qcg_gpu.indexing.throughput import record_throughput
    from qcg_gpu.llm.backends import llm_name

    docs, config = sample_docs(tmp_path / "docs", 3), _config(tmp_path)
    model = llm_name(config.generation)
    record_throughput(config.generation, model, chunks=1, output_tokens=98, seconds=7.78)
    plan = forecast(docs, config)
    assert plan.chunks > 1 and plan.tokens_per_s == 12.6
    assert f"in a run of 1 chunk; this build keeps up to {plan.chunks} requests in flight" in plan.rate_source
    assert "likely an overestimate" in plan.format() and "measured run of 1 chunk on" in plan.output_source
    record_throughput(config.generation, model, chunks=plan.chunks, output_tokens=9000, seconds=50.0)
    plan = forecast(docs, config)
    assert plan.tokens_per_s == 180.0 and plan.rate_source.endswith(f"in a run of {plan.chunks} chunks")


def _sample_split(tmp_path, n_old: int):
    """The whole bundled LiHuaWorld sample (27 chat logs), its first ``n_old`` in one directory and
    the rest in another (doc ids keep their week folder)."""
    every = sorted(SAMPLE_DOCS.rglob("*.txt"))
    dirs = {name: tmp_path / name for name in ("old", "new", "all")}
    for i, path in enumerate(every):
        for name in ("old" if i < n_old else "new", "all"):
            target = dirs[name] / path.relative_to(SAMPLE_DOCS)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, target)
    return dirs["old"], dirs["new"], dirs["all"], [p.relative_to(SAMPLE_DOCS).with_suffix("").as_posix() for p in every]


def test_remove_keeps_an_old_index_without_a_list_of_earlier_replies(tmp_path, embedder):
    """An index built before replies_from_earlier_runs was recorded does not gain an empty list on
    remove: it would claim that no reply came from an earlier run."""
    import json

    old, _, _ = _split_docs(tmp_path, 3, 1)
    build_index(old, tmp_path / "idx", _config(tmp_path, nodes="sentence"), embedder=embedder)
    doomed = sorted(p.stem for p in old.glob("*.txt"))[:1]
    manifest_file = tmp_path / "idx" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    assert manifest.pop("replies_from_earlier_runs") == []  # sentence nodes: no LLM replies at all
    manifest_file.write_text(json.dumps(manifest))
    remove_documents(tmp_path / "idx", doomed)
    assert "replies_from_earlier_runs" not in read_manifest(tmp_path / "idx")


def test_updates_equal_rebuilds_bit_for_bit_on_chat_logs_full_of_near_ties(tmp_path, embedder):
    """Chat logs hold many near-identical sentences ("Great!", "Thanks!", emoji-only lines): with
    embeddings that depended on their batch, near-ties flipped and kNN rows differed (issue 15)."""
    old, new, every, doc_ids = _sample_split(tmp_path, 18)
    config = _config(tmp_path, nodes="sentence")
    config.graph.knn_k = 3
    build_index(old, tmp_path / "grown", config, embedder=embedder)
    add_documents(tmp_path / "grown", new, config, embedder=embedder)
    build_index(every, tmp_path / "full", config, embedder=embedder)
    for name in ("node_embeddings", "knn_indices", "knn_scores"):
        np.testing.assert_array_equal(load_array(tmp_path / "grown", name), load_array(tmp_path / "full", name), name)

    removed = doc_ids[2:5]
    remove_documents(tmp_path / "grown", removed)
    for path in removed:
        (every / f"{path}.txt").unlink()
    build_index(every, tmp_path / "rest", config, embedder=embedder)
    for name in ("node_embeddings", "knn_indices", "knn_scores"):
        np.testing.assert_array_equal(load_array(tmp_path / "grown", name), load_array(tmp_path / "rest", name), name)


class _AddsWhileEmbedding(Embedder):
    """The real embedder, and once, while the rebuild embeds, another writer's add to the same index:
    a concurrency a person would hit by running qcg index add during qcg index build --overwrite."""

    def __init__(self, embedder, index, new, config):
        self.__dict__.update(embedder.__dict__)
        self.add = lambda: add_documents(index, new, config, embedder=embedder)

    def encode(self, texts, *args, **kwargs):
        if self.add:
            add, self.add = self.add, None
            add()
        return super().encode(texts, *args, **kwargs)


def test_a_rebuild_does_not_publish_over_an_add_that_finished_while_it_ran(tmp_path, embedder):
    old, new, _ = _split_docs(tmp_path, 2, 1)
    config = _config(tmp_path, nodes="sentence")
    build_index(old, tmp_path / "index", config, embedder=embedder)
    racing = _AddsWhileEmbedding(embedder, tmp_path / "index", new, config)
    with pytest.raises(QCGError, match="changed while this build ran: another writer published v-"):
        build_index(old, tmp_path / "index", config, overwrite=True, embedder=racing)
    manifest = read_manifest(tmp_path / "index")
    assert [h["op"] for h in manifest["history"]] == ["add"] and manifest["counts"]["documents"] == 3  # not lost
    versions = [p.name for p in (tmp_path / "index").iterdir() if p.name.startswith("v-")]
    assert len(versions) == 2 and manifest["data_dir"] in versions  # the build's, the add's; the refused one gone


def test_two_builds_of_one_new_index_end_in_one_clear_line(tmp_path, embedder):
    docs = sample_docs(tmp_path / "docs", 2)
    config = _config(tmp_path, nodes="sentence")

    class BuildsWhileEmbedding(Embedder):  # the other build finishes while this one embeds
        def __init__(self):
            self.__dict__.update(embedder.__dict__)
            self.other = lambda: build_index(docs, tmp_path / "index", config, embedder=embedder)

        def encode(self, texts, *args, **kwargs):
            if self.other:
                other, self.other = self.other, None
                other()
            return super().encode(texts, *args, **kwargs)

    with pytest.raises(QCGError, match="changed while this build ran: another writer published v-.* over nothing"):
        build_index(docs, tmp_path / "index", config, embedder=BuildsWhileEmbedding())
    assert read_manifest(tmp_path / "index")["counts"]["documents"] == 2  # the other build's index, whole
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".index")] == []  # nothing left aside
