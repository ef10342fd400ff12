"""Scale-out on Ray: the index build and batch retrieval split over workers (GPUs, nodes).

The single-process code is reused step by step; Ray only decides where each heavy step
runs, with the same inputs and outputs. A full build goes shard by shard (:mod:`sharded`,
over the pieces here); ``--add`` uses them on its new chunks directly.

* Doc2Query generation (:class:`RayLLM`): the chunks that have no reply yet, shared out
  to one vLLM engine per worker (per tensor x pipeline parallel group of GPUs on a GPU
  cluster), each keeping its window of requests in flight and streaming every reply back as
  it finishes. The driver caches each one as it arrives, so a failure loses nothing
  finished, exactly like the single-process build. :class:`RayDataLLM` runs the same engines
  through ray.data.llm's vLLM processor (``--ray-llm``; the default on GPU clusters).
* Embedding: one embedder per worker, kept for the whole build: each takes whole shards
  (``sharded._ShardWorker``) or, for ``--add``, blocks of batches (:class:`RayEmbedder`).
* kNN graph (:func:`knn_graph_of_parts`): row blocks searched and ranked exactly by
  tasks over the embeddings in Ray's shared-memory object store, then concatenated; of an index
  stored as node shards, a task per shard over the shards' files (:func:`knn_of_shards`, exact or
  IVF), and for an add to one, a task per shard growing its rows (:func:`grow_shards_on`).
* Retrieval (``retrieval/ray_backend.py``): each worker holds the index (through the
  object store, zero-copy), the queries are split in order and the results put back together.

Given the same LLM replies (the generation cache), the index equals the single-process
one byte for byte: an embedding does not depend on its batch (:mod:`embedding`) nor on the thread
count (each worker runs its share's), and the kNN rows are ranked exactly. The replies themselves can
differ between two runs that batch differently: LLM kernels are not batch-invariant (vLLM, any
engine).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os

import numpy as np

from ..capabilities import require, with_cuda
from ..cluster import RayCluster
from ..config import GenerationConfig, NodeConfig
from ..embedding import Windows, encode_whole, shape_batches, token_counts
from ..errors import QCGError
from ..index_format import IndexWriter
from ..llm import vllm_compat
from ..llm.backends import (
    BATCH_INVARIANT,
    REPLAY,
    Completion,
    LLMBackend,
    SamplingSpec,
    collect,
    engine_settings,
    llm_name,
    request_seed,
)
from ..log import counted, engine_log_level, errors_only, progress_bar, quiet
from ..models import DEFAULT_EMBEDDER, DEFAULT_LLM, resolve_model
from . import ivf
from .knn import KnnGraph, exact_rows, grown_shard_rows, shard_rows
from .ranking import degree

EMBED_BLOCK_BATCHES = 8  # embedder batches per block sent to one worker


def ray_llm(cluster: RayCluster, config: GenerationConfig) -> RayLLM:
    """Doc2Query engines on ``cluster``'s workers: ray.data.llm's processor or qcg's own actors (``--ray-llm``)."""
    return RayDataLLM(config, cluster) if cluster.uses_ray_data_llm() else RayLLM(config, cluster)


def knn_graph_of_parts(
    cluster: RayCluster, parts: list, n: int, k: int, backend: str = "auto", device: str | None = None, probes=None
) -> KnnGraph:
    """:func:`knn.knn_graph` of ``n`` rows given as ``parts`` (object refs of float32 row blocks,
    in order, made by the workers), its row blocks searched and ranked by Ray tasks (an approximate
    graph, ``probes``: after one task has found every node's lists). A task joins the parts in the
    object store: this process never holds them."""
    k_eff = degree(k, n)
    if k_eff == 0:
        return KnnGraph.from_rows(np.zeros((n, 0), np.int64), np.zeros((n, 0), np.float32))
    cluster.release()
    ray = cluster.ray
    shared = ray.remote(_concatenate).remote(*parts)
    bounds = [(int(b[0]), int(b[-1]) + 1) for b in np.array_split(np.arange(n), cluster.workers * 4) if len(b)]
    if probes is None:
        task = cluster.task(_knn_rows)
        futures = [task.remote(shared, start, stop, k_eff, backend, device) for start, stop in bounds]
    else:
        lists = cluster.task(ivf.graph_lists).remote(shared, probes, backend, device)
        task = cluster.task(ivf.graph_rows)
        futures = [task.remote(shared, start, stop, k_eff, lists, backend, device) for start, stop in bounds]
    rows = cluster.gather(futures, "kNN blocks")
    return KnnGraph.from_rows(np.concatenate([ids for ids, _ in rows]), np.concatenate([s for _, s in rows]))


def knn_of_shards(cluster: RayCluster, writer: IndexWriter, k: int, backend: str, device, probes=None) -> None:
    """The kNN graph of a sharded index being written: one Ray task per node shard reads the shards'
    embeddings from the writer's files, one at a time, and each shard's rows are written as they come
    back (the driver holds one shard's rows at a time). Exact (:func:`knn.shard_rows`) or, with
    ``probes``, approximate (:mod:`ivf`): one task trains the centroids on every shard's training
    rows, a task per shard finds its nodes' lists, then a task per shard ranks its rows against the
    members of every shard. The workers read the files where the writer writes them: a shared file
    system on several nodes."""
    assert writer.shards is not None
    cluster.release()
    data, shards = str(writer.data), range(len(writer.shards))
    layout = {"shards": [s.to_dict() for s in writer.shards]}
    if probes is None:
        task = cluster.task(shard_rows)
        pending = {task.remote(data, layout, i, k, backend, device): i for i in shards}
    else:
        centroids = cluster.task(ivf.centroids_of_shards).remote(data, layout)
        lists_task = cluster.task(ivf.shard_lists, num_returns=2)
        lists = [lists_task.remote(data, layout, i, centroids, probes, backend, device) for i in shards]
        own_lists = [own for _, own in lists]  # in a list: each task fetches them one shard at a time
        task = cluster.task(_ivf_shard_rows)
        pending = {task.remote(data, layout, i, k, lists[i][0], own_lists, backend, device): i for i in shards}
    write_as_done(cluster, writer, pending)


def grow_shards_on(cluster: RayCluster, writer: IndexWriter, data, manifest: dict, new: np.ndarray, config) -> None:
    """:func:`knn.grow_shards` with a Ray task per shard: each old shard's rows grown against ``new`` (put
    in the object store once), each new shard's searched over the writer's files (a shared file system on
    several nodes), written as they come back."""
    assert writer.shards is not None
    cluster.release()
    ray, n_old = cluster.ray, len(manifest["shards"])
    backend, device, k = config.graph.knn_backend, config.nodes.device, config.graph.knn_k
    old, layout = {"shards": manifest["shards"]}, {"shards": [s.to_dict() for s in writer.shards]}
    grow, search = (cluster.task(f) for f in (grown_shard_rows, shard_rows))
    added = ray.put(np.asarray(new, np.float32))
    pending = {grow.remote(str(data), old, i, added, backend, device): i for i in range(n_old)}
    for i in range(n_old, len(writer.shards)):
        pending[search.remote(str(writer.data), layout, i, k, backend, device)] = i
    write_as_done(cluster, writer, pending)


def write_as_done(cluster: RayCluster, writer: IndexWriter, pending: dict) -> None:
    """Write each shard's kNN rows as its task ends (``pending``: task -> shard): the driver holds one at a time."""
    with progress_bar(total=len(pending), desc="kNN shards", unit="shard") as bar:
        while pending:
            [done], _ = cluster.ray.wait(list(pending), num_returns=1)
            writer.write_shard_graph(pending.pop(done), *cluster.ray.get(done))
            bar.update(1)


def _concatenate(*parts: np.ndarray) -> np.ndarray:
    return np.concatenate(parts)


def _knn_rows(emb: np.ndarray, start: int, stop: int, k: int, backend: str, device: str | None):
    return exact_rows(emb, np.arange(start, stop), k, backend, device)


def _ivf_shard_rows(data: str, layout: dict, shard: int, k: int, lists, own_lists: list, backend: str, device):
    import ray

    return ivf.shard_rows(data, layout, shard, k, lists, lambda i: ray.get(own_lists[i]), backend, device)


# ---- generation: one streaming engine per worker (per tensor x pipeline parallel group on GPUs) ----


class _LLMWorker:
    """One LLM backend per actor, loaded once; each call streams its share's replies as they finish."""

    def __init__(self, generation: dict):
        from ..llm.backends import make_backend

        if not with_cuda():  # Ray gives each actor its cores (OMP_NUM_THREADS); vLLM must not pin to all of them
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        quiet()  # the driver shows the progress; one bar per engine would bury it
        self.llm = make_backend(GenerationConfig(**generation))

    def reproducibility(self) -> str:
        return self.llm.reproducibility()

    def stream(self, rows: list[int], conversations: list, sampling: SamplingSpec, window: int):
        """(rows, completions) as requests finish: the engine keeps ``window`` requests in flight and
        takes the next as each one finishes, so it never drains until its share is done."""
        for positions, completions in self.llm.chat_batches(conversations, sampling, window):
            yield [rows[i] for i in positions], completions


class RayLLM(LLMBackend):
    """An LLM backend whose conversations are answered by a pool of engines on Ray workers.

    Each engine gets an interleaved share of the conversations in one streaming call, keeps
    ``batch_size`` of them in flight, and hands back every reply as it finishes; ``chat_batches``
    yields them in that order, so the caller can cache each one. On a GPU cluster an engine
    spans ``tensor_parallel_size x pipeline_parallel_size`` GPUs, so there are GPUs / that many."""

    def __init__(self, config: GenerationConfig, cluster: RayCluster):
        self.config, self.cluster = config, cluster
        self.model_name = llm_name(config)
        self.group = config.tensor_parallel_size * config.pipeline_parallel_size
        self.multi_gpu = bool(cluster.gpus) and self.group > 1  # each engine spans a group of GPUs
        self.engine_statements: list[str] = []  # each engine's own promise, once it has answered

    def reproducibility(self) -> str:
        engines = len(self.engine_statements)
        each = "; ".join(sorted(set(self.engine_statements))) or "no engine has answered yet"
        return (
            f"{counted(engines, 'vLLM engine')} on Ray, a generation run's conversations dealt out to the engines in "
            f"turn, so a reply depends on the engine count too; each engine: {each}"
        )

    @property
    def workers(self) -> int:
        """Engines: one per worker, or per group of GPUs when an engine spans several."""
        if self.multi_gpu:
            return max(1, min(self.cluster.workers, self.cluster.gpus // self.group))
        return self.cluster.workers

    def chat(self, conversations, sampling: SamplingSpec) -> list[Completion]:
        return collect(self.chat_batches(conversations, sampling, self.config.batch_chunks), len(conversations))

    def _engines(self, count: int) -> list:
        """The engines: loaded on the first call, kept for the next ones (a sharded build asks shard by shard)."""
        generation = dataclasses.asdict(self.config)
        if self.multi_gpu:
            engine_args = {**self.config.extra_engine_args(), "distributed_executor_backend": "ray"}
            generation["engine_args"] = json.dumps(engine_args)
            return self.cluster.engine_actors(_LLMWorker, generation, count=count, gpus_each=self.group, reuse=True)
        return self.cluster.actors(_LLMWorker, generation, count=count, reuse=True)

    def chat_batches(self, conversations, sampling: SamplingSpec, batch_size: int):
        """(rows, completions) as replies finish (:meth:`_replies`), with a progress bar; a failure
        on Ray ends the run with one line."""
        if not conversations:
            return
        bar = progress_bar(total=len(conversations), desc="LLM replies", unit="reply")
        try:
            for rows, completions in self._replies(conversations, sampling, batch_size):
                bar.update(len(rows))
                yield rows, completions
        except self.cluster.ray.exceptions.RayError as exc:
            raise QCGError(
                f"generation on Ray failed (the replies that finished are cached; rerun to go on): {exc}"
            ) from exc
        finally:
            bar.close()

    def _replies(self, conversations, sampling: SamplingSpec, batch_size: int):
        """Each engine actor's share in one streaming call; its replies as they come back."""
        ray = self.cluster.ray
        engines = self._engines(min(self.workers, len(conversations)))
        self.engine_statements = ray.get([engine.reproducibility.remote() for engine in engines])
        shares = [list(range(i, len(conversations), len(engines))) for i in range(len(engines))]
        streams = [
            engine.stream.options(num_returns="streaming").remote(
                share, [conversations[r] for r in share], sampling, batch_size
            )
            for engine, share in zip(engines, shares)
            if share
        ]
        while streams:
            [ready], _ = ray.wait(streams, num_returns=1)
            try:
                yield ray.get(next(ready))
            except StopIteration:
                streams.remove(ready)


class RayDataLLM(RayLLM):
    """The same engines run by ray.data.llm's vLLM processor: Ray Data starts them (placement groups
    for multi-GPU engines are its own), feeds each batches of rows, keeps several batches in flight
    per engine, and streams the finished rows back; each reply is handed over as it arrives.
    The light stages (our pre- and postprocessing, chat template, tokenizer, detokenizer) reserve no
    core, so that the engines get every core (on a CPU cluster, a reserved share for them would leave
    an engine unplaced, or one engine on every core would leave the preprocessing unplaced, and the run
    waiting for ever)."""

    def __init__(self, config: GenerationConfig, cluster: RayCluster):
        super().__init__(config, cluster)
        self.path = resolve_model(config.model, DEFAULT_LLM)[0]

    def reproducibility(self) -> str:
        if self.config.batch_invariant:
            return BATCH_INVARIANT
        return (
            "per-request seeds on ray.data.llm's vLLM engines (--ray-llm data): each keeps several batches in "
            "flight in an engine core of its own, so which requests share a step depends on timing, and two "
            f"identical runs can differ where two tokens are almost equally likely; {REPLAY}"
        )

    def processor(self, engines: int, batch_size: int):
        llm = require("ray.data.llm")
        engine_kwargs = engine_settings(self.config, self.path, on_gpu=bool(self.cluster.gpus))
        del engine_kwargs["model"]
        level = engine_log_level()
        env = {"VLLM_LOGGING_LEVEL": level}
        if level != "INFO":  # vLLM's start-up scan of every module touches a deprecated torch name
            ours = "ignore::FutureWarning:vllm.triton_utils.dispatcher"
            env["PYTHONWARNINGS"] = ",".join(filter(None, (os.environ.get("PYTHONWARNINGS"), ours)))
        if self.config.batch_invariant:
            vllm_compat.batch_invariant_mode(bool(self.cluster.gpus))
            env["VLLM_BATCH_INVARIANT"] = "1"  # the engines' processes are Ray's, not children of this one
        if not self.cluster.gpus:  # as for the actors: Ray shares out the cores, vLLM must not pin to all
            env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ENABLE_V1_MULTIPROCESSING="0")
            # its async engine reserves this share of the machine's memory for its KV cache (0.92 by
            # default, refused when not free): half the memory, split between the engines on a node
            engine_kwargs["gpu_memory_utilization"] = 0.5 / engines
        light = {"num_cpus": 0}
        cpus = self.cluster.worker_resources.get("num_cpus", 1)  # an engine's cores on a CPU cluster
        config = llm.vLLMEngineProcessorConfig(
            model_source=self.path,
            engine_kwargs=engine_kwargs,
            concurrency=engines,
            batch_size=batch_size,
            should_continue_on_error=True,  # a failed request comes back as a row with its error
            log_engine_metrics=False,  # vLLM's Ray metrics need ray[serve]
            runtime_env={"env_vars": env},
            placement_group_config=None if self.cluster.gpus else {"bundles": [{"CPU": cpus}]},
            chat_template_stage=llm.ChatTemplateStageConfig(**light),
            tokenize_stage=llm.TokenizerStageConfig(**light),
            detokenize_stage=llm.DetokenizeStageConfig(**light),
        )
        return llm.build_processor(
            config,
            preprocess=_request_row,
            postprocess=_reply_row,
            preprocess_map_kwargs=light,  # a core each by default: with one engine on every core, none was left
            postprocess_map_kwargs=light,
        )

    def _replies(self, conversations, sampling: SamplingSpec, batch_size: int):
        """The conversations as Ray Data rows through the processor; each reply as its row comes back."""
        rows = [
            {"row": i, "messages": conversation, "sampling_params": ray_sampling(sampling, conversation)}
            for i, conversation in enumerate(conversations)
        ]
        engines = min(self.workers, len(conversations))
        # Rows per Ray Data batch: a quarter of the window. The processor keeps up to 8 batches in flight
        # per engine, so an engine is refilled batch by batch as earlier ones finish instead of draining.
        processor = self.processor(engines, max(1, batch_size // 4))
        with _ray_data_progress(self.cluster.ray, shown=engine_log_level() == "INFO"):
            for out in processor(self.cluster.ray.data.from_items(rows)).iter_rows():
                yield [int(out["row"])], [_completion_of_row(out)]


@contextlib.contextmanager
def _ray_data_progress(ray, shown: bool):
    """Ray Data's own progress (~100 log lines a run where stderr is not a terminal) shown only with
    --verbose, as the "LLM replies" bar shows the same; set back afterwards, for a caller's own pipelines."""
    context = ray.data.DataContext.get_current()
    before, context.enable_progress_bars = context.enable_progress_bars, shown
    try:
        with contextlib.nullcontext() if shown else errors_only("ray.data"):
            yield
    finally:
        context.enable_progress_bars = before


def ray_sampling(sampling: SamplingSpec, conversation) -> dict:
    """One request's vLLM sampling parameters as a Ray Data row field (the JSON schema as text, so
    that Arrow stores it as it is)."""
    params: dict = dict(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=sampling.max_tokens,
        repetition_penalty=sampling.repetition_penalty,
        seed=request_seed(sampling.seed, conversation),
    )
    if sampling.json_schema:
        params["structured_outputs"] = {"json": json.dumps(sampling.json_schema)}
    return params


def _request_row(row: dict) -> dict:
    # the engine stage consumes sampling_params: its token cap goes on in a column of its own
    params = row["sampling_params"]
    return {"row": row["row"], "messages": row["messages"], "sampling_params": params, "cap": params["max_tokens"]}


def _reply_row(row: dict) -> dict:
    return {
        "row": row["row"],
        "text": row["generated_text"],
        "prompt_tokens": row["num_input_tokens"],
        "output_tokens": row["num_generated_tokens"],
        # ray.data.llm does not pass vLLM's finish reason on: a reply that used every token it
        # was allowed was cut there
        "finish_reason": "length" if row["num_generated_tokens"] >= row["cap"] else "stop",
    }


def _completion_of_row(out: dict) -> Completion:
    if out.get("__inference_error__"):  # the row skipped _reply_row
        return Completion(error=f"vLLM on Ray Data: {out['__inference_error__']}"[:500])
    return Completion(out["text"], int(out["prompt_tokens"]), int(out["output_tokens"]), out["finish_reason"])


# ---- embedding: one embedder per worker ----


class EmbedWorker:
    """An embedder in a Ray actor, on its share of the cores (:class:`RayCluster`), whatever the driver
    runs: the bits do not depend on the thread count (capabilities.MKL_REPRODUCIBLE, tests/test_cpu_kinds.py)."""

    def __init__(self, model: str | None, device: str | None, batch_size: int, long_texts: str = "truncate"):
        from ..embedding import Embedder

        quiet()  # the driver shows the progress: no bars from the workers, the model's loading bar included
        # "truncate": RayEmbedder's driver splits long texts itself
        self.embedder = Embedder(model, device, batch_size, long_texts)

    def describe(self) -> tuple[str, int, int]:
        return self.embedder.model_name, self.embedder.dim, self.embedder.max_tokens

    def encode_batches(self, batches: list[tuple[list[str], int]]) -> list[np.ndarray]:
        return [self.embedder.encode_batch(texts, length) for texts, length in batches]


class RayEmbedder:
    """:class:`embedding.Embedder`'s interface, with the texts embedded by one embedder per worker."""

    def __init__(self, config: NodeConfig, cluster: RayCluster):
        self.cluster, self.batch_size = cluster, config.embed_batch_size
        self._workers = cluster.actors(EmbedWorker, config.embedder, config.device, config.embed_batch_size)
        self.model_name, self.dim, self.max_tokens = cluster.ray.get(self._workers[0].describe.remote())
        path = resolve_model(config.embedder, DEFAULT_EMBEDDER)[0]
        self.tokenizer = require("transformers").AutoTokenizer.from_pretrained(path)  # the model's, on the driver
        # long texts are split here, as one process splits them
        self.windows = Windows(self.tokenizer, self.max_tokens) if config.long_texts == "mean" else None
        self.windowed_texts = 0

    def encode(self, texts: list[str], desc: str = "embed") -> np.ndarray:
        return encode_whole(self, texts, lambda pieces: self._encode_pieces(pieces, desc))

    def _encode_pieces(self, texts: list[str], desc: str) -> np.ndarray:
        from ray.util import ActorPool

        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        batches = shape_batches(token_counts(self.tokenizer, texts, self.max_tokens), self.batch_size, self.max_tokens)
        blocks = [batches[s : s + EMBED_BLOCK_BATCHES] for s in range(0, len(batches), EMBED_BLOCK_BATCHES)]
        # The pool hands a block to whichever worker is free, so only one block per worker is in flight.
        results = ActorPool(self._workers).map(
            lambda worker, block: worker.encode_batches.remote([([texts[r] for r in rows], n) for rows, n in block]),
            blocks,
        )
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for block, vectors in zip(blocks, progress_bar(results, total=len(blocks), desc=desc, unit="block")):
            for (rows, _), batch in zip(block, vectors):
                out[rows] = batch
        return out
