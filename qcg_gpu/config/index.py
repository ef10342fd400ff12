"""The index build's settings: chunking, nodes and graph, and IndexConfig, which joins them with generation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..errors import QCGError
from .generation import GenerationConfig
from .utils import check_at_least, check_fields, option, result_fields, setting_name

NODE_MODES = ("qa", "q", "a", "sentence")

# How an index recorded before an option existed was built, where that differs from the option's default.
BEFORE_OPTION: dict[str, dict[str, object]] = {
    "nodes": {"long_texts": "truncate"},
    "generation": {"compact_json": False, "max_pair_tokens": 0},
}
# The sections whose settings decide the LLM replies (the chunk texts, the prompt, the sampling).
REPLY_SECTIONS = ("chunking", "generation")
# Files of the machine that ran a build: a manifest records their names only, and they are never read back.
MACHINE_PATHS = {"generation": ("cache", "replies_in", "replies_out")}


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
        check_fields(self)
        check_at_least(self, 1, "chunk_tokens")
        if not 0 <= self.chunk_overlap < self.chunk_tokens:
            raise QCGError(
                f"{setting_name(self, 'chunk_overlap')} must be in [0, --chunk-tokens), got {self.chunk_overlap}"
            )
        return self


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
        check_fields(self)
        if not 0 < self.alpha <= 1:
            raise QCGError(f"{setting_name(self, 'alpha')} must be in (0, 1], got {self.alpha}")
        check_at_least(self, 1, "embed_batch_size")
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
        check_fields(self)
        check_at_least(self, 1, "knn_k", "knn_probes", "shard_nodes")
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
