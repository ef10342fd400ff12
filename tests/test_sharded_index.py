"""The node-sharded index format (issue 36): shards cut between chunks, ids global, every file
checksummed, and the joined shards equal to the same build stored whole (real builds, real files)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from qcg_gpu import build_index
from qcg_gpu.config import IndexConfig
from qcg_gpu.errors import QCGError
from qcg_gpu.index_format import (
    ARRAYS,
    SHARDED_FORMAT_VERSION,
    TABLES,
    data_dir,
    index_shards,
    load_array,
    load_shard_array,
    load_shard_table,
    load_table,
    plan_shards,
    read_manifest,
)
from qcg_gpu.integrity import check_index
from qcg_gpu.retrieval import QCGIndex, RetrievalConfig, Retriever

from .conftest import DEVICES, KNN_BACKENDS, sample_docs
from .test_retrieval import queries_for

SHARD_NODES = 60


def sentence_config(shard_nodes: int | None = None, knn_k: int | None = None) -> IndexConfig:
    config = IndexConfig()
    config.nodes.nodes, config.nodes.device = "sentence", "cpu"
    config.graph.shard_nodes = shard_nodes
    config.graph.knn_k = knn_k or config.graph.knn_k
    return config


@pytest.fixture(scope="module")
def whole_and_sharded(tmp_path_factory, embedder):
    """The same eight LiHuaWorld chat logs indexed (sentence nodes) whole and in shards of <= 60 nodes."""
    root = tmp_path_factory.mktemp("sharded")
    docs = sample_docs(root / "docs", 8)
    build_index(docs, root / "whole", sentence_config(), embedder=embedder)
    build_index(docs, root / "sharded", sentence_config(SHARD_NODES), embedder=embedder)
    return root / "whole", root / "sharded"


def assert_same_index(whole, sharded):
    """Every array and table of ``sharded``, its shards joined, equals ``whole``'s."""
    for name in ARRAYS:
        a, b = load_array(whole, name), load_array(sharded, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    for name in TABLES:
        assert load_table(whole, name).equals(load_table(sharded, name)), name


def test_plan_cuts_between_chunks_and_gives_a_big_chunk_its_own_shard():
    node_chunk = np.array([0, 0, 0, 1, 1, 3, 3, 3, 3, 3, 4])  # chunk 2 has no node, chunk 3 has 5
    shards = plan_shards(node_chunk, 6, 4)
    assert [(s.nodes, s.chunks) for s in shards] == [
        ((0, 3), (0, 1)),
        ((3, 5), (1, 3)),
        ((5, 10), (3, 4)),
        ((10, 11), (4, 6)),
    ]
    assert [s.nodes for s in plan_shards(node_chunk, 6, None)] == [(0, 11)]
    assert [s.nodes for s in plan_shards(node_chunk, 6, 11)] == [(0, 11)]
    with pytest.raises(QCGError, match="must be >= 1"):
        plan_shards(node_chunk, 6, 0)
    with pytest.raises(QCGError, match="chunk by chunk"):
        plan_shards(np.array([1, 0]), 2, 1)


def test_sharded_build_equals_the_whole_one(whole_and_sharded):
    whole, sharded = whole_and_sharded
    manifest = read_manifest(sharded)
    shards = index_shards(manifest)
    assert manifest["format_version"] == SHARDED_FORMAT_VERSION and len(shards) > 2
    assert "shards" not in read_manifest(whole)
    node_chunk = load_table(whole, "nodes").column("chunk_id").to_numpy()
    for shard in shards:
        lo, hi = shard.nodes
        assert 0 < hi - lo <= SHARD_NODES or len(set(node_chunk[lo:hi])) == 1
        ids = load_shard_table(sharded, manifest, shard, "nodes").column("chunk_id").to_numpy()
        assert np.array_equal(ids, node_chunk[lo:hi])  # global chunk ids, the shard's own chunks
        assert ids.min() >= shard.chunks[0] and ids.max() < shard.chunks[1]
        emb = load_shard_array(sharded, manifest, shard, "node_embeddings")
        assert np.array_equal(emb, load_array(whole, "node_embeddings")[lo:hi])
    assert_same_index(whole, sharded)
    assert check_index(sharded) == []
    a, b = QCGIndex.load(whole), QCGIndex.load(sharded)
    queries = a.node_embeddings[::7] + 0.01
    config = RetrievalConfig(gamma=1.0, hops=2)
    ra, rb = Retriever(a, config).search(queries), Retriever(b, config).search(queries)
    for name in ("chunk_ids", "scores", "seed_ids", "seed_sims", "n_selected"):
        assert np.array_equal(getattr(ra, name), getattr(rb, name)), name


def test_a_corrupt_or_missing_shard_is_refused(whole_and_sharded, tmp_path):
    _, sharded = whole_and_sharded
    copy = tmp_path / "index"
    shutil.copytree(sharded, copy)
    manifest = read_manifest(copy)
    victim = data_dir(copy) / index_shards(manifest)[1].file("node_embeddings.npy")
    emb = np.load(victim)
    emb[0, 0] += 0.5
    np.save(victim, emb)
    problems = check_index(copy)
    assert any("shards/00001/node_embeddings.npy does not match its checksum" in p for p in problems), problems
    with pytest.raises(QCGError, match="00001/node_embeddings.npy does not match its checksum"):
        QCGIndex.load(copy)
    victim.unlink()
    assert any("missing shards/00001/node_embeddings.npy" in p for p in check_index(copy))
    with pytest.raises(QCGError, match="missing shards/00001/node_embeddings.npy"):
        QCGIndex.load(copy)


def test_a_manifest_cannot_name_files_outside_the_index(whole_and_sharded, tmp_path):
    whole, _ = whole_and_sharded
    copy = tmp_path / "index"
    shutil.copytree(whole, copy)
    path = copy / "manifest.json"
    manifest = json.loads(path.read_text())
    outside = {**manifest, "data_dir": "../elsewhere"}
    path.write_text(json.dumps(outside))
    with pytest.raises(QCGError, match="not a folder of the index"):
        QCGIndex.load(copy)
    escaping = {**manifest, "files": {**manifest["files"], "../../../../etc/passwd": "0" * 64}}
    path.write_text(json.dumps(escaping))
    assert any("not a file of the index" in p for p in check_index(copy))
    path.write_text("[1, 2]")
    with pytest.raises(QCGError, match="a JSON object was expected"):
        QCGIndex.load(copy)


def test_shard_nodes_zero_is_refused_in_one_line(cli, tmp_path):
    result = cli("index", "build", tmp_path, tmp_path / "out", "--nodes", "sentence", "--shard-nodes", "0")
    assert result.returncode == 2 and "--shard-nodes (shard_nodes) must be >= 1, got 0" in result.stderr


def test_a_remove_on_ray_of_an_index_of_one_shard_is_refused_before_a_cluster_starts(whole_and_sharded, cli):
    result = cli("index", "remove", whole_and_sharded[0], "20260105_1400", "--ray")
    assert result.returncode == 2 and "is one shard, and its removal runs in this process" in result.stderr
    assert "Ray" not in result.stderr


OWNER_BACKENDS = [("numpy", "cpu", p) for p in ("off", "int8", "bf16")]
OWNER_BACKENDS += [("torch", device, p) for device in DEVICES for p in ("off", "bf16")]


@pytest.mark.parametrize(("backend", "device", "prefilter"), [pytest.param(*b, id="-".join(b)) for b in OWNER_BACKENDS])
def test_shard_owners_in_this_process_equal_one_process(whole_and_sharded, backend, device, prefilter):
    from qcg_gpu.retrieval.retriever import local_backend
    from qcg_gpu.retrieval.shard_backend import local_owners

    whole, sharded = whole_and_sharded
    one = QCGIndex.load(whole)
    queries = queries_for(one, 3, 100, noise=0.05)
    for owners in (1, 3):
        sharded_backend = local_owners(sharded, read_manifest(sharded), owners, local_backend)
        for hops in (0, 1, 2):
            config = RetrievalConfig(
                gamma=1.3, hops=hops, n=10, top_k=5, backend=backend, device=device, prefilter=prefilter
            )
            one_process = Retriever(one, config)
            want, got = one_process.search(queries), sharded_backend.search(queries, config)
            assert {type(o._backend(config)) for o in sharded_backend.owners} == {type(one_process.backend)}
            assert want.n_selected.min() > 0 and (hops == 0 or want.n_selected.max() > 10)
            for name in RESULT_FIELDS:
                assert np.array_equal(getattr(want, name), getattr(got, name)), (owners, hops, name)


@pytest.mark.parametrize("device", DEVICES)
def test_a_shard_owner_holds_its_nodes_once(whole_and_sharded, device):
    """A torch owner on a GPU frees the host's copy of its nodes (the GPU's copy is what it searches)
    and reads them again from the shard files for a CPU backend; on the CPU, torch searches the owner's
    array itself. Either way the results are one process's."""
    from qcg_gpu.retrieval.retriever import local_backend
    from qcg_gpu.retrieval.shard_backend import local_owners

    whole, sharded = whole_and_sharded
    one = QCGIndex.load(whole)
    queries = queries_for(one, 5, 50, noise=0.05)
    sharded_backend = local_owners(sharded, read_manifest(sharded), 2, local_backend)
    on_torch = RetrievalConfig(gamma=1.3, hops=1, n=10, top_k=5, backend="torch", device=device)
    on_numpy = dataclasses.replace(on_torch, backend="numpy", device=None)
    for config in (on_torch, on_numpy):
        if config is on_numpy and device == "cpu":
            for owner in sharded_backend.owners:
                owner.local = None  # as a GPU backend leaves it, so that the numpy one reads its nodes again
        want, got = Retriever(one, config).search(queries), sharded_backend.search(queries, config)
        for name in RESULT_FIELDS:
            assert np.array_equal(getattr(want, name), getattr(got, name)), (config.backend, name)
        for owner in sharded_backend.owners:
            if config is on_torch and device != "cpu":
                assert owner.local is None
            else:
                nodes = owner.local.node_embeddings
                assert len(nodes) == owner.end_node - owner.first_node
                if config is on_torch:
                    assert owner._backend(config).nodes.data_ptr() == nodes.ctypes.data


@pytest.fixture(scope="module")
def cluster():
    import ray

    from qcg_gpu.cluster import RayCluster
    from qcg_gpu.config import RayConfig

    started = RayCluster(RayConfig(ray=True, ray_workers=2))
    yield started
    ray.shutdown()


def test_numba_and_torch_in_a_task_or_an_actor_keep_to_its_share_of_the_cores(cluster):
    """Numba starts a thread per core of the machine, and as its pool starts it sets OpenMP's thread
    count, which torch shares, to its own. In a Ray task or actor (embedders, kNN tasks, shard owners,
    query-split workers) both keep to its share of the cores, so W of them on one machine do not run
    W x cores threads (the IVF kernels' time doubled so at W = 2, and a build's embedding stage took 4.3x as long)."""
    import numba
    import torch

    from qcg_gpu.indexing.sharded import _ShardWorker
    from qcg_gpu.kernels.seeds_cpu import top_n_above

    def threads():
        top_n_above(np.ones((2, 5), np.float32), np.float32(0.5), 2)  # numba's pool started
        return numba.get_num_threads(), torch.get_num_threads()

    class Embedder(_ShardWorker):
        def threads(self):
            return threads()

    share = cluster.worker_resources.get("num_cpus", 1)
    if share >= min(numba.config.NUMBA_NUM_THREADS, torch.get_num_threads()):
        pytest.skip("a worker's share is every core of this machine: nothing to tell apart")
    each = [(share, share)] * cluster.workers
    assert cluster.gather([cluster.task(threads).remote() for _ in range(cluster.workers)]) == each
    actors = cluster.actors(Embedder, sentence_config().nodes)
    assert cluster.gather([a.threads.remote() for a in actors]) == each
    cluster.release()


RESULT_FIELDS = ("chunk_ids", "scores", "seed_ids", "seed_sims", "n_selected")


@pytest.mark.parametrize("prefilter", ["off", "int8"])
def test_shard_parallel_retrieval_on_ray_equals_one_process(whole_and_sharded, cluster, prefilter):
    whole, sharded = whole_and_sharded
    one = QCGIndex.load(whole)
    driver = QCGIndex.load(sharded, nodes=False)  # the driver holds no node array
    assert driver.n_nodes == 0 and len(driver.shards) > 2
    queries = queries_for(one, 7, 64, noise=0.05)
    for hops in (0, 1, 2):
        config = RetrievalConfig(gamma=1.3, hops=hops, n=8, top_k=5, prefilter=prefilter)
        want = Retriever(one, config).search(queries)
        got = Retriever(driver, config, cluster).search(queries)
        assert want.n_selected.min() > 0 and (hops == 0 or want.n_selected.max() > 8)
        for name in RESULT_FIELDS:
            assert np.array_equal(getattr(want, name), getattr(got, name)), (hops, name)
    # each worker opened its own shards' files, and no other worker's
    from qcg_gpu.retrieval.shard_backend import owner_groups

    groups = owner_groups(driver.shards, cluster.workers)
    opened = cluster.ray.get([actor.files_opened.remote() for actor in cluster._actors])
    assert len(opened) == len(groups) == 2
    for files, group in zip(opened, groups):
        shard_dirs = {Path(f).parent.name for f in files}
        assert shard_dirs == {s.name for s in group}, (shard_dirs, [s.name for s in group])


GPU_CLUSTER_SCRIPT = """
import json, sys
import numpy as np, ray
from qcg_gpu.cluster import RayCluster
from qcg_gpu.config import RayConfig
from qcg_gpu.retrieval import QCGIndex, RetrievalConfig, Retriever

whole, sharded, *fields = sys.argv[1:]
ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
cluster = RayCluster(RayConfig(ray=True))
one, driver = QCGIndex.load(whole), QCGIndex.load(sharded, nodes=False)
rng = np.random.default_rng(3)
queries = one.node_embeddings[rng.choice(one.n_nodes, 32)] + rng.normal(0, 0.05, (32, one.dim))
config = RetrievalConfig(gamma=1.3, hops=2, n=8, top_k=5)
want, got = Retriever(one, config).search(queries), Retriever(driver, config, cluster).search(queries)
print(json.dumps({
    "workers": cluster.workers,
    "resources": cluster.worker_resources,
    "gpu_ids": sorted(ray.get([a.gpu_ids.remote() for a in cluster._actors])),
    "equal": [bool(np.array_equal(getattr(want, f), getattr(got, f))) for f in fields],
}))
"""


def test_shard_owners_on_a_cluster_with_gpus_take_a_gpu_each(whole_and_sharded):
    """On a Ray cluster with GPUs, there is a shard owner per GPU, each an actor holding one GPU of its own
    (Ray makes it the only one the actor sees, so the owner's torch ``cuda`` is it), and the result is
    one process's. Ray's GPUs are declared here (logical): the owners find no CUDA and search with numpy,
    so what runs is the placement; on a machine with GPUs the same code searches on them."""
    import subprocess
    import sys

    whole, sharded = whole_and_sharded
    run = subprocess.run(
        [sys.executable, "-c", GPU_CLUSTER_SCRIPT, str(whole), str(sharded), *RESULT_FIELDS],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["workers"] == 2 and report["resources"] == {"num_gpus": 1}
    assert report["gpu_ids"] == [[0], [1]]
    assert report["equal"] == [True] * len(RESULT_FIELDS)


def test_query_on_ray_reads_shards_and_refuses_bad_input(whole_and_sharded, tmp_path, cli, cluster):
    whole, sharded = whole_and_sharded
    cluster.release()  # the command makes its own RayCluster in this process: it needs the workers' CPUs
    question = "When does Li Hua meet Adam?"
    one = cli("query", whole, "--query", question, "--gamma", "1.0", "--hops", "2", "--quiet")
    assert one.returncode == 0, one.stderr[-2000:]
    result = cli("query", sharded, "--query", question, "--gamma", "1.0", "--hops", "2", "--quiet", "--ray")
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["chunks"] == json.loads(one.stdout)["chunks"]
    refused = cli("query", whole, "--query", question, "--ray", "--ray-mode", "shards", "--quiet")
    assert refused.returncode == 2 and "--ray-mode shards needs an index stored as several shards" in refused.stderr
    copy = tmp_path / "index"
    shutil.copytree(sharded, copy)
    victim = data_dir(copy) / index_shards(read_manifest(copy))[-1].file("knn_indices.npy")
    victim.write_bytes(victim.read_bytes()[:-8] + b"\x00" * 8)
    damaged = cli("query", copy, "--query", question, "--ray", "--quiet")
    assert damaged.returncode == 2 and "knn_indices.npy does not match its checksum" in damaged.stderr
    assert len(damaged.stderr.strip().splitlines()) == 1, damaged.stderr


def test_add_and_remove_on_a_sharded_index_equal_sharded_rebuilds(tmp_path, embedder, monkeypatch):
    from qcg_gpu.indexing import incremental
    from qcg_gpu.indexing.incremental import add_documents, remove_documents

    def whole(path):
        raise AssertionError(f"{path} was loaded whole")

    monkeypatch.setattr(incremental._Stored, "load", whole)  # neither update may take the whole-index path

    from .test_incremental import _docs_but, _split_docs
    from .test_incremental import assert_same_index as assert_equivalent  # floats to 1e-5: batches differ

    old, new, every = _split_docs(tmp_path, 4, 4)
    config = sentence_config(SHARD_NODES)
    build_index(old, tmp_path / "grown", config, embedder=embedder)
    before = read_manifest(tmp_path / "grown")
    add_documents(tmp_path / "grown", new, config, embedder=embedder)
    build_index(every, tmp_path / "full", config, embedder=embedder)
    assert_equivalent(tmp_path / "grown", tmp_path / "full")
    # the add wrote new shards after the old ones, whose files it kept (hard links) but for their kNN rows
    after = read_manifest(tmp_path / "grown")
    kept, grown = index_shards(before), index_shards(after)
    assert len(kept) >= 2 and grown[: len(kept)] == kept and len(grown) > len(kept)
    for name in ("nodes.parquet", "chunks.parquet", "node_embeddings.npy", "knn_indices.npy"):
        inode = [(data_dir(tmp_path / "grown", m) / kept[0].file(name)).stat().st_ino for m in (before, after)]
        assert (inode[0] == inode[1]) == (name != "knn_indices.npy"), name
    assert after["history"][-1]["op"] == "add" and check_index(tmp_path / "grown") == []

    # the remove went shard by shard: the old shards, less what was removed, renumbered (none reused)
    removed = sorted(p.stem for p in old.glob("*.txt"))[:2]
    remove_documents(tmp_path / "grown", removed)
    build_index(_docs_but(every, removed, tmp_path / "rest"), tmp_path / "rest_index", config, embedder=embedder)
    assert_equivalent(tmp_path / "grown", tmp_path / "rest_index")
    shrunk = index_shards(read_manifest(tmp_path / "grown"))
    assert 2 <= len(shrunk) <= len(grown) and [s.name for s in shrunk] == [f"{i:05d}" for i in range(len(shrunk))]
    assert shrunk[-1].nodes[1] - shrunk[-1].nodes[0] == grown[-1].nodes[1] - grown[-1].nodes[0]  # untouched: moved
    assert read_manifest(tmp_path / "grown")["history"][-1]["op"] == "remove"
    assert check_index(tmp_path / "grown") == []


def test_a_ray_build_of_fewer_shards_than_workers_spreads_them_over_every_worker(tmp_path):
    """A --ray build's staged shards are cut, at chunk boundaries, into one per worker or more where there
    are fewer: each worker embeds one shard at a time, and a corpus of one shard (below 8,192 chunks)
    left the others idle. The cut shards hold the same chunks and pairs in order, renumbered within each."""
    from qcg_gpu.indexing.chunking import Chunk
    from qcg_gpu.indexing.sharded import Staging
    from qcg_gpu.indexing.stages import Pairs

    chunks = [Chunk("doc", i, 10, f"text {i}") for i in range(5)]
    pairs = Pairs(np.array([0, 0, 2, 3, 3, 4]), np.array([0, 1, 0, 0, 1, 0]), list("abcdef"), list("ABCDEF"))
    staging = Staging(tmp_path / "staging")
    staging.put_input(chunks, pairs)
    staging.put_input(chunks[:1], Pairs(np.array([0]), np.array([0]), ["g"], ["G"]))
    staging.spread(5)  # 3 pieces a shard where it has the chunks: the second has one
    assert [count["chunks"] for count in staging.counts] == [2, 2, 1, 1]
    inputs = [staging.input(shard) for shard in staging.shards()]
    assert [c for part, _ in inputs for c in part] == chunks + chunks[:1]
    assert [p.chunk_id.tolist() for _, p in inputs] == [[0, 0], [0, 1, 1], [0], [0]]
    assert [p.question for _, p in inputs] == [["a", "b"], ["c", "d", "e"], ["f"], ["g"]]
    assert [count["pairs"] for count in staging.counts] == [2, 3, 1, 1]
    staging.spread(2)  # enough shards already
    assert staging.shards() == range(4)


def test_a_ray_build_writes_the_same_shards(whole_and_sharded, tmp_path, cluster):
    import dataclasses

    _, sharded = whole_and_sharded
    docs = sharded.parent / "docs"
    config = sentence_config(SHARD_NODES)
    saved = cluster.config
    cluster.config = dataclasses.replace(saved, ray_shard_chunks=3)  # build shards (chunks) across node shards
    try:
        build_index(docs, tmp_path / "ray", config, cluster=cluster)
    finally:
        cluster.config = saved
    assert index_shards(read_manifest(tmp_path / "ray")) == index_shards(read_manifest(sharded))
    assert_same_index(sharded, tmp_path / "ray")


def test_an_add_and_a_remove_on_ray_give_the_same_shards(tmp_path, embedder, cluster, monkeypatch):
    """An add to a sharded index with a cluster (a Ray task per shard grows its kNN rows), then a remove
    (a Ray task per shard renumbers its rows and searches those that lost an edge), each equal to the same
    update in this process, file for file."""
    from qcg_gpu.indexing import shard_removal
    from qcg_gpu.indexing.incremental import add_documents, remove_documents

    from .test_incremental import _split_docs

    old, new, _ = _split_docs(tmp_path, 4, 4)
    config = sentence_config(SHARD_NODES)
    build_index(old, tmp_path / "here", config, embedder=embedder)
    shutil.copytree(tmp_path / "here", tmp_path / "ray")
    before = index_shards(read_manifest(tmp_path / "here"))
    add_documents(tmp_path / "here", new, config, embedder=embedder)
    add_documents(tmp_path / "ray", new, config, embedder=embedder, cluster=cluster)
    grown = index_shards(read_manifest(tmp_path / "ray"))
    assert grown[: len(before)] == before and len(grown) > len(before)
    assert_same_index(tmp_path / "here", tmp_path / "ray")

    original, on_ray = shard_removal.kept_rows_on, []  # the removal's kNN rows go to the cluster's tasks
    monkeypatch.setattr(shard_removal, "kept_rows_on", lambda *args: on_ray.append(original(*args)))
    gone = sorted(set(load_table(tmp_path / "here", "chunks").column("doc_id").to_pylist()))[1:3]
    remove_documents(tmp_path / "here", gone)
    remove_documents(tmp_path / "ray", gone, cluster=cluster)
    assert len(on_ray) == 1
    assert_same_index(tmp_path / "here", tmp_path / "ray")


def test_a_retry_on_ray_equals_the_retry_in_this_process(tmp_path, vllm_backend, embedder, cluster, monkeypatch):
    """qcg index retry --ray on a sharded pair-node index (a chunk's LLM request failed): its kNN rows are a
    Ray task per shard, and the repaired index equals the one the same retry gives in this process."""
    from qcg_gpu.indexing import shard_removal
    from qcg_gpu.indexing.incremental import _Stored, retry_failed
    from qcg_gpu.llm.backends import Completion

    from .test_index_build import Recording, _config

    def fault(i, completion):
        return Completion(error="RuntimeError: engine died") if i == 1 else completion

    config = _config(tmp_path)
    config.graph.shard_nodes, config.graph.knn_k = 1, 1  # a shard per chunk; k = 1 keeps the few nodes' degree
    docs = sample_docs(tmp_path / "docs", 4)
    build_index(docs, tmp_path / "here", config, llm=Recording(vllm_backend, fault), embedder=embedder)
    shutil.copytree(tmp_path / "here", tmp_path / "ray")
    monkeypatch.setattr(_Stored, "load", lambda index: pytest.fail("a sharded retry loaded the index whole"))
    original, on_ray = shard_removal.kept_rows_on, []
    monkeypatch.setattr(shard_removal, "kept_rows_on", lambda *args: on_ray.append(original(*args)))
    retry_failed(tmp_path / "here", config, llm=vllm_backend, embedder=embedder)
    assert not on_ray
    llm = Recording(vllm_backend)
    retry_failed(tmp_path / "ray", config, llm=llm, embedder=embedder, cluster=cluster)
    assert len(on_ray) == 1 and llm.asked == []  # the failed chunk's reply is cached by the first retry
    assert read_manifest(tmp_path / "ray")["counts"]["chunks_failed"] == 0
    assert_same_index(tmp_path / "here", tmp_path / "ray")


@pytest.mark.parametrize("shard_nodes", [SHARD_NODES, None], ids=["shards", "whole"])
def test_an_approximate_graph_built_on_ray_equals_one_process(whole_and_sharded, tmp_path, cluster, shard_nodes):
    """--knn approximate --ray: the IVF graph from a task per node shard (or, of an index stored whole, per
    block of rows, once a task has found every node's lists) equals the one-process build's, and it is not
    the exact graph (one list probed a node)."""
    _, sharded = whole_and_sharded
    docs = sharded.parent / "docs"
    config = sentence_config(shard_nodes)
    config.graph.knn, config.graph.knn_probes = "approximate", 1
    build_index(docs, tmp_path / "one", config)
    build_index(docs, tmp_path / "ray", config, cluster=cluster)
    assert_same_index(tmp_path / "one", tmp_path / "ray")
    assert not np.array_equal(load_array(tmp_path / "one", "knn_indices"), load_array(sharded, "knn_indices"))


def write_node_shards(emb: np.ndarray, path: Path):
    """``emb`` written as the node shards of an index (5 nodes a chunk, shards of <= 37 nodes)."""
    from qcg_gpu.index_format import ArrayParts, IndexWriter

    node_chunk = np.arange(len(emb)) // 5
    writer = IndexWriter(path, plan_shards(node_chunk, int(node_chunk[-1]) + 1, 37))
    writer.write_array("node_embeddings", ArrayParts(emb.shape, emb.dtype, [emb]))
    return writer, {"shards": [s.to_dict() for s in writer.shards]}


def node_embeddings(whole, data: str) -> np.ndarray:
    emb = np.asarray(load_array(whole, "node_embeddings"))
    return np.repeat(emb[::3], 3, axis=0) if data == "ties" else emb  # ties: each row's best edges tie


@pytest.mark.parametrize("data", ["real", "ties"])
@pytest.mark.parametrize("backend,device", KNN_BACKENDS)
def test_shard_by_shard_knn_equals_the_one_process_graph(whole_and_sharded, tmp_path, data, backend, device):
    """knn.shard_rows (a task per shard on Ray; its candidates searched by each kNN backend, a GPU's
    included) against knn.knn_graph on the same nodes: every edge and score equal, on real embeddings and
    on many exact duplicates (ties broken by lower id across shards)."""
    from qcg_gpu.indexing.knn import knn_graph, shard_rows

    emb = node_embeddings(whole_and_sharded[0], data)
    writer, layout = write_node_shards(emb, tmp_path / "index")
    want = knn_graph(emb, 4)
    rows = [shard_rows(str(writer.data), layout, s, 4, backend, device) for s in range(len(writer.shards))]
    writer.abort()
    assert np.array_equal(np.concatenate([r[1] for r in rows]), want.indices)
    assert np.array_equal(np.concatenate([r[2] for r in rows]), want.scores)


@pytest.mark.parametrize("data", ["real", "ties"])
def test_growing_shards_equals_adding_nodes_in_one_process(whole_and_sharded, tmp_path, data):
    """knn.grow_shards (each old shard's rows against the new nodes, each new shard's over every shard)
    against knn.add_nodes on the same nodes: every edge and score equal. With ties, a new node tied with a
    row's k-th edge stays out (it has the higher id), as in a rebuild."""
    from qcg_gpu.index_format import ArrayParts, IndexWriter, plan_added_shards
    from qcg_gpu.indexing.knn import add_nodes, grow_shards, knn_graph

    emb = node_embeddings(whole_and_sharded[0], data)
    n_old = len(emb) // 15 * 10  # at a chunk boundary (5 nodes a chunk)
    old, new = emb[:n_old], emb[n_old:]
    before, layout = write_node_shards(old, tmp_path / "before")
    before.write_graph(*dataclasses.astuple(knn_graph(old, 4)))
    node_chunk = np.arange(len(emb)) // 5
    shards = before.shards + plan_added_shards(before.shards, node_chunk[n_old:], int(node_chunk[-1]) + 1, 37)
    after = IndexWriter(tmp_path / "after", shards)
    after.write_array("node_embeddings", ArrayParts(emb.shape, emb.dtype, [emb]))
    grow_shards(after, before.data, layout, new, sentence_config(knn_k=4))
    got = {
        name: load_array(after.data, name, manifest={"shards": [s.to_dict() for s in shards]}, verify=False)
        for name in ("knn_indices", "knn_scores")
    }
    before.abort(), after.abort()
    want = add_nodes(knn_graph(old, 4), old, new, 4)
    assert np.array_equal(got["knn_indices"], want.indices) and np.array_equal(got["knn_scores"], want.scores)
    assert np.array_equal(want.indices, knn_graph(emb, 4).indices)
    changed = (want.indices[: n_old * 4] != knn_graph(old, 4).indices).reshape(n_old, 4).any(axis=1)
    assert 0 < changed.sum() < n_old  # some old rows took new nodes, some did not


@pytest.mark.parametrize("data", ["real", "ties"])
@pytest.mark.parametrize("k", [4, 40])
def test_shard_by_shard_ivf_equals_the_one_process_approximate_graph(whole_and_sharded, tmp_path, monkeypatch, data, k):
    """ivf's three passes over shard files (centroids from every shard's training rows, each shard's lists,
    each shard's rows against every shard's members) against ivf_graph of all nodes: equal edge for edge,
    with lists that miss true edges, and (k = 40) rows whose probed lists hold fewer than k nodes. Blocks
    of 7 rows, so that the sample and the rows are copied and ranked in several."""
    from qcg_gpu.indexing import ivf
    from qcg_gpu.indexing.knn import knn_graph

    monkeypatch.setattr(ivf, "ROW_BLOCK", 7)

    emb = node_embeddings(whole_and_sharded[0], data)
    writer, layout = write_node_shards(emb, tmp_path / "index")
    data_path, shards = str(writer.data), range(len(writer.shards))
    centroids = ivf.centroids_of_shards(data_path, layout)
    trained_whole = ivf.train_centroids(emb[ivf.training_rows(len(emb))], ivf.list_count(len(emb)))
    assert np.array_equal(centroids, trained_whole) and len(centroids) > 2
    lists = [ivf.shard_lists(data_path, layout, s, centroids, 1) for s in shards]
    rows = [ivf.shard_rows(data_path, layout, s, k, lists[s][0], lambda i: lists[i][1]) for s in shards]
    writer.abort()
    want_ids, want_scores = ivf.ivf_graph(emb, k, 1, centroids=centroids)
    assert np.array_equal(np.concatenate([r[1] for r in rows]), want_ids.ravel())
    assert np.array_equal(np.concatenate([r[2] for r in rows]), want_scores.ravel())
    assert not np.array_equal(want_ids.ravel(), knn_graph(emb, k).indices)  # one list a node misses edges


def test_an_index_derived_in_memory_is_not_taken_for_its_shards(whole_and_sharded):
    """qcg eval's ablations derive indexes in this process: on Ray they go whole to the workers, never
    to owners that would load the original index's shard files."""
    from qcg_gpu.eval.variants import derive_index
    from qcg_gpu.retrieval.retriever import ray_mode

    _, sharded = whole_and_sharded
    derived = derive_index(QCGIndex.load(sharded), knn_k=3)
    assert derived.shards == [] and ray_mode("shards", derived.manifest) == "queries"
    assert ray_mode("auto", read_manifest(sharded)) == "shards"


def test_eval_on_ray_over_shards_equals_one_process(whole_and_sharded, tmp_path, cli, cluster, monkeypatch):
    """qcg eval --ray on an index of node shards: the driver loads no node array, QCG retrieves shard by
    shard (its hops sweep too) and the baseline in the driver; every record equals the one-process run's.
    Work that derives an index from every node is refused in one line."""
    from .test_eval import QUESTIONS

    whole, sharded = whole_and_sharded
    cluster.release()  # the command makes its own RayCluster in this process: it needs the workers' CPUs
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    args = ("eval", "--dataset", "jsonl", "--data", questions, "--no-answers", "--quiet", "--methods", "naive,qcg")
    one = cli(*args, "--sweeps", "hops", "--index", whole, "--out", tmp_path / "one")
    assert one.returncode == 0, one.stderr[-2000:]
    loads = []
    real_load = QCGIndex.load.__func__
    monkeypatch.setattr(
        QCGIndex, "load", classmethod(lambda cls, *a, **kw: loads.append(kw) or real_load(cls, *a, **kw))
    )
    on_ray = cli(*args, "--sweeps", "hops", "--index", sharded, "--out", tmp_path / "ray", "--ray")
    assert on_ray.returncode == 0, on_ray.stderr[-2000:]
    assert loads and all(kw.get("nodes") is False for kw in loads), loads  # the driver holds no node array
    for name in ("results.jsonl", "sweep_hops.csv"):
        assert (tmp_path / "ray" / name).read_text() == (tmp_path / "one" / name).read_text(), name
    assert (tmp_path / "ray" / "report.html").is_file()
    refused = cli(
        *args, "--methods", "qcg,qcg-sentence", "--sweeps", "knn", "--index", sharded, "--out", tmp_path, "--ray"
    )
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "qcg-sentence, --sweeps knn derive an index from every node in this process" in refused.stderr
