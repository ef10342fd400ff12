"""Settings of an index build: one dataclass per concern.

Each field's ``help`` is written once here and reused as CLI help
(``qcg index --help``). Defaults follow ../shared/METHOD.md (the paper).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from .errors import QCGError

NODE_MODES = ("qa", "q", "a", "sentence")


def _opt(default, help: str, choices=None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class ChunkingConfig:
    chunk_tokens: int = _opt(1200, "Tokens per chunk (the paper's other setting is 512).")
    chunk_overlap: int = _opt(100, "Tokens shared by consecutive chunks of a document (paper: 100, or 64 with 512).")
    tokenizer: str = _opt(
        "cl100k_base",
        "Tokenizer that counts chunk tokens: 'cl100k_base' (tiktoken, bundled offline) or a HF tokenizer name/directory.",
    )

    def validate(self) -> None:
        if self.chunk_tokens < 1:
            raise QCGError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if not 0 <= self.chunk_overlap < self.chunk_tokens:
            raise QCGError(f"chunk_overlap must be in [0, chunk_tokens), got {self.chunk_overlap}")


@dataclass
class GenerationConfig:
    backend: str = _opt("vllm", "LLM backend for Doc2Query: in-process vLLM or an OpenAI-compatible server.", ("vllm", "openai"))
    model: Optional[str] = _opt(
        None,
        "Doc2Query LLM: HF model directory or name (default: bundled SmolLM2-135M-Instruct; with --backend openai, the served model name).",
    )
    m: int = _opt(20, "Question-answer pairs asked of the LLM per chunk (M).")
    temperature: float = _opt(0.3, "Sampling temperature of the Doc2Query LLM.")
    top_p: float = _opt(0.95, "Nucleus sampling of the Doc2Query LLM.")
    repetition_penalty: float = _opt(
        1.1,
        "Penalty on repeated tokens; without it small models repeat one pair M times. Use 1.0 for APIs that reject the field (OpenAI's).",
    )
    seed: int = _opt(0, "Sampling seed (same seed + same inputs = same pairs on the same engine).")
    max_question_chars: int = _opt(200, "Longest question the JSON schema allows (bounds output tokens).")
    max_answer_chars: int = _opt(150, "Longest answer the JSON schema allows.")
    max_tokens: Optional[int] = _opt(None, "Output token cap per chunk (default: enough for M pairs at the length caps).")
    max_model_len: Optional[int] = _opt(None, "vLLM context length (default: the model's).")
    gpu_memory_utilization: float = _opt(0.9, "vLLM: share of GPU memory the engine may use (GPU only).")
    enforce_eager: bool = _opt(True, "vLLM: skip graph capture/compilation (fast start; compiled mode gains ~8%% on CPU).")
    batch_chunks: int = _opt(
        2048,
        "Chunks per batched LLM call; results are cached after each batch so an interrupted run loses at most one batch.",
    )
    base_url: Optional[str] = _opt(None, "OpenAI-compatible backend: server URL, e.g. http://127.0.0.1:8000/v1.")
    api_key_env: str = _opt("OPENAI_API_KEY", "OpenAI-compatible backend: environment variable holding the API key.")
    concurrency: int = _opt(16, "OpenAI-compatible backend: requests in flight at once.")
    max_retries: int = _opt(5, "OpenAI-compatible backend: retries (exponential backoff) on 429/5xx/timeouts.")
    request_timeout: float = _opt(300.0, "OpenAI-compatible backend: seconds before one request times out.")
    structured_output: bool = _opt(True, "Constrain the LLM to the pairs JSON schema (turn off for servers that lack it).")
    cache: Optional[str] = _opt(
        None, "Generation cache (SQLite file) keyed by chunk text, model, prompt, M and sampling (default: user cache dir)."
    )

    def validate(self) -> None:
        if self.m < 1:
            raise QCGError(f"m must be >= 1, got {self.m}")
        if self.backend == "openai" and not self.base_url:
            raise QCGError("--backend openai needs --base-url (e.g. http://127.0.0.1:8000/v1)")
        if self.backend == "openai" and not self.model:
            raise QCGError("--backend openai needs --model (the served model's name)")


@dataclass
class NodeConfig:
    embedder: Optional[str] = _opt(None, "Sentence-transformers model (default: bundled all-MiniLM-L6-v2).")
    alpha: float = _opt(0.8, "Doc2Query--: keep the top ceil(alpha * m_i) pairs of each chunk by similarity to it.")
    nodes: str = _opt("qa", "Node text: question+answer (default), question, answer, or each sentence of a chunk (no LLM).", NODE_MODES)
    device: Optional[str] = _opt(None, "Torch device for embedding and kNN (default: cuda when present, else cpu).")
    embed_batch_size: int = _opt(128, "Texts per embedder batch.")
    embedding_dtype: str = _opt("float32", "dtype of node_embeddings.npy.", ("float32", "float16"))

    def validate(self) -> None:
        if not 0 < self.alpha <= 1:
            raise QCGError(f"alpha must be in (0, 1], got {self.alpha}")


@dataclass
class GraphConfig:
    knn_k: int = _opt(2, "kNN edges per node: its k nearest other nodes by cosine (paper: 2 LiHuaWorld, 3 MultiHop-RAG).")
    knn_backend: str = _opt("auto", "kNN search: faiss, torch (tiled matmul+topk), or auto (faiss when installed).", ("auto", "faiss", "torch"))

    def validate(self) -> None:
        if self.knn_k < 1:
            raise QCGError(f"knn_k must be >= 1, got {self.knn_k}")


@dataclass
class IndexConfig:
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    nodes: NodeConfig = field(default_factory=NodeConfig)
    graph: GraphConfig = field(default_factory=GraphConfig)

    SECTIONS = ("chunking", "generation", "nodes", "graph")

    def validate(self) -> "IndexConfig":
        for name in self.SECTIONS:
            getattr(self, name).validate()
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
